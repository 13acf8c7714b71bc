"""One pass around the ring of ranks, shared by the ring modes of ClipLoss (clipshard/parallel/ring.py) and
SigLipLoss (clipshard/parallel/siglip_ring.py); docs/distributed.md, "Ring mode".

Rank r of N keeps its image rows. At step k = 0 .. N-1 it holds the text block of rank
q = (r - k) mod N: `blocks` hands it out with the next block already in flight from rank r - 1
(and the current one on its way to rank r + 1), so the transfer runs during the caller's work on
the block; two block buffers, whatever N. `Travelling` is an accumulator per text block that follows
its block one step behind: every rank folds its part in and passes it on, and after N hops it is
back with the block's owner, complete. Point-to-point transfers only (`batch_isend_irecv`, a send
to the next rank and a receive from the previous one in one batch, the pattern NCCL needs to avoid
a deadlock in a ring); the order of every fold is fixed, so results are bitwise reproducible.
Under torch.compile a shift is a functional all-to-all with one non-empty send and receive
(traced_collectives.ring_shift), which dynamo traces; the compiler places its wait.
"""
import torch
import torch.distributed as dist

from clipshard.parallel import traced_collectives as traced

# gloo matches point-to-point messages by (peer, tag): blocks and travelling buffers use their own
# tags (NCCL ignores tags and matches in issue order, which is the same on every rank).
_BLOCK_TAG, _TRAVEL_TAG = 1, 2


class Ring:
    """This rank's neighbours: it sends to the next rank and receives from the previous one."""

    def __init__(self, layout):
        n, r = layout.world_size, layout.rank
        self.layout = layout
        self.next = dist.get_global_rank(layout.group, (r + 1) % n)
        self.prev = dist.get_global_rank(layout.group, (r - 1) % n)

    def block_size(self, step):
        """Rows of the text block this rank holds at `step` (that of rank (r - step) mod N)."""
        layout = self.layout
        return layout.sizes[(layout.rank - step) % layout.world_size]

    def shift(self, sends, receive_into, tag):
        """Start sending every tensor of `sends` to the next rank and receiving into the buffers
        `receive_into` from the previous rank; returns a handle for `wait`, which returns the
        received tensors (under torch.compile new tensors shaped like the buffers)."""
        group, n, r = self.layout.group, self.layout.world_size, self.layout.rank
        if torch.compiler.is_compiling():
            return None, [traced.ring_shift(t, like, (r + 1) % n, (r - 1) % n, n, group)
                          for t, like in zip(sends, receive_into)]
        ops = [dist.P2POp(dist.isend, t, self.next, group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, group, tag) for t in receive_into]
        # the tensors must stay alive until the transfer is done: keep them with the works
        return dist.batch_isend_irecv(ops), receive_into, sends

    @staticmethod
    def wait(handle):
        if handle is None:
            return None
        for work in handle[0] or ():
            work.wait()
        return handle[1]


def blocks(ring, text, companion=None):
    """Yields (step, block, companion) for step = 0 .. N-1: this rank's text block at step 0, then
    the blocks of ranks r - 1, r - 2, ... The next block is in flight while the caller works on the
    current one. `companion` (optional): what travels with the block, a tensor or a tuple of
    tensors, each with last dimension K_q, e.g. its full column LSE (clipshard/parallel/ring.py's
    backward) or its sample ids; yielded in the form it was given."""
    n = ring.layout.world_size
    block = text.contiguous()
    single = companion is None or torch.is_tensor(companion)
    companions = () if companion is None else (companion,) if single else tuple(companion)
    companions = tuple(c.contiguous() for c in companions)
    for step in range(n):
        handle = None
        if step < n - 1:
            k_next = ring.block_size(step + 1)
            next_block = block.new_empty(k_next, block.shape[1])
            next_companions = tuple(c.new_empty(*c.shape[:-1], k_next) for c in companions)
            handle = ring.shift([block, *companions], [next_block, *next_companions], _BLOCK_TAG)
        yield step, block, (companions[0] if companions else None) if single else companions
        received = ring.wait(handle)
        handle = None  # the block sent is done with: freed before the next buffer is allocated
        if step < n - 1:
            block, companions = received[0], tuple(received[1:])


class Travelling:
    """The accumulator of the block this rank holds, one step behind the block: `fold(step, part)`
    folds this rank's part of the block of `step` into the accumulator received from the previous
    rank (step 0: starts it with `fold(None, part)`) and sends it on; after step N - 1, `result()`
    is the finished accumulator of this rank's own block, after its N-th hop."""

    def __init__(self, ring, combine):
        self.ring, self.combine = ring, combine
        self.handle = self.received = None

    def arrive(self):
        """Waits for the accumulator of the block this rank holds now (step >= 1) and frees the one it
        sent: called before the work on the block, so that two accumulators, not three, are alive
        during it (the one that arrived and the buffer of the next); `fold` calls it otherwise."""
        if self.handle is not None:
            self.received = self.ring.wait(self.handle)[0]
            self.handle = None

    def fold(self, step, part):
        if step == 0:
            accumulator = self.combine(None, part)
        else:
            self.arrive()
            accumulator, self.received = self.combine(self.received, part), None
        shape = (self.ring.block_size(step + 1),) + tuple(accumulator.shape[1:])
        self.handle = self.ring.shift([accumulator], [accumulator.new_empty(shape)], _TRAVEL_TAG)

    def result(self):
        self.arrive()
        result, self.received = self.received, None
        return result
