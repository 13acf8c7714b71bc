"""clipshard's integrations with other libraries: open_clip (open_clip_*.py, coca_loss.py) and
Hugging Face transformers (transformers_*.py).

The core (ops, losses, optimizer, distributed layer) never imports this package; each module here
imports its library only when it is used, so `import clipshard` needs neither open_clip nor
transformers. docs/open_clip.md, docs/transformers.md.
"""
