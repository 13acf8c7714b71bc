"""`python -m clipshard.open_clip_train`: the public command's name, kept where it always was.

The program itself is clipshard.integrations.open_clip_train (docs/open_clip.md); this module only
runs its main().
"""
import sys

from clipshard.integrations.open_clip_train import main

if __name__ == "__main__":
    sys.exit(main())
