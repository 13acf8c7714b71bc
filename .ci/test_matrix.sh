#!/usr/bin/env bash
# The version matrix (`make test-matrix`): the integration tests against the other transformers and
# open_clip releases clipshard supports, each in its own small venv next to .venv. A matrix venv
# holds only that release and the packages whose versions it needs (pip installs those; everything
# else, torch included, comes from .venv through a .pth file that adds .venv's site-packages after
# the venv's own, so the release installed here shadows .venv's). .venv itself runs the default
# versions (requirements-dev.txt) in `make test`. Created once, reused while the pins below hold.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MATRIX=${MATRIX:-.venv-matrix}
MAIN_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

# venv NAME "PIP_SPECS": creates $MATRIX/NAME (once per spec list) and checks which version imports there
venv() {
    local dir="$MATRIX/$1" spec="$2"
    if [ "$(cat "$dir/.spec" 2>/dev/null)" != "$spec" ]; then
        rm -rf "$dir"
        "$PY" -m venv --without-pip "$dir"
        local site
        site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        echo "import site; site.addsitedir('$MAIN_SITE')" > "$site/_clipshard_main_venv.pth"
        # shellcheck disable=SC2086  # several specs, split on spaces
        "$dir/bin/python" -m pip install -q --disable-pip-version-check $spec
        echo "$spec" > "$dir/.spec"
    fi
}

# run NAME MODULE TEST_ARGS...: the tests in venv NAME, after checking that MODULE is the venv's own
run() {
    local name="$1" module="$2"; shift 2
    local dir="$MATRIX/$name" start=$SECONDS
    "$dir/bin/python" -c "import $module, sys; f = $module.__file__; print('$name:', '$module', $module.__version__, f)
sys.exit(0 if f.startswith('$(realpath "$dir")') or f.startswith('$dir') else 'imported from .venv, not the matrix venv')"
    PYTHONPATH="$PWD" "$dir/bin/python" -m pytest -q -p no:cacheprovider "$@"
    echo "$name: $((SECONDS - start)) s"
}

HF=tests/integrations/transformers
OC=tests/integrations/open_clip
THREE_RANKS=$HF/test_transformers_distributed.py::test_loss_and_ddp_gradients_equal_the_global_batch[3]
ST=tests/integrations/sentence_transformers
start=$SECONDS
# transformers 4.x needs huggingface-hub < 1.0, and transformers.trainer imports datasets when it is
# installed: .venv's datasets needs a newer hub, so these venvs hold a datasets that accepts 0.x
venv transformers-4.50 "transformers==4.50.3 datasets==4.4.2"
venv transformers-4.57 "transformers==4.57.6 datasets==4.4.2"
venv open_clip-2.26 open_clip_torch==2.26.1
venv sentence_transformers-6.0 sentence-transformers==6.0.0
echo "matrix venvs: $((SECONDS - start)) s"
# the oldest supported transformers: 1 and 2 ranks, GradCache through the patch, and Trainer on 2 ranks
run transformers-4.50 transformers $HF/test_transformers_patch.py $HF/test_transformers_distributed.py \
    $HF/test_grad_cache_transformers.py $HF/test_transformers_trainer.py --deselect "$THREE_RANKS"
# the last 4.x: 1 and 2 ranks, GradCache through the patch
run transformers-4.57 transformers $HF/test_transformers_patch.py $HF/test_transformers_distributed.py \
    $HF/test_grad_cache_transformers.py --deselect "$THREE_RANKS"
# the oldest supported open_clip (the first with open_clip_train as a package): the patch, the text
# tower, and open_clip_train against stock with its default flags, distillation, and the 16-bit
# recipe with its resume (the loss-flag variants do not depend on the release)
run open_clip-2.26 open_clip $OC/test_open_clip_patch.py $OC/test_open_clip_text_tower.py \
    $OC/test_open_clip_train.py --deselect "$OC/test_open_clip_train.py::test_fp32_losses_match_stock_open_clip_train[local+gather]"
# the oldest supported sentence-transformers: the patch and its fallbacks, 1 and 2 ranks
run sentence_transformers-6.0 sentence_transformers $ST/test_sentence_transformers_patch.py \
    $ST/test_sentence_transformers_distributed.py --deselect "$ST/test_sentence_transformers_distributed.py::test_ranks[3]"
echo "matrix: $((SECONDS - start)) s"
