"""`python -m clipshard`: the environment report and kernel self-check (clipshard/diagnostics)."""
import sys

from clipshard.diagnostics.self_check import main

if __name__ == "__main__":
    sys.exit(main())
