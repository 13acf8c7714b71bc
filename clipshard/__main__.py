"""`python -m clipshard`: the environment report and kernel self-check (clipshard/diagnostics);
`python -m clipshard plan ...`: a memory plan (clipshard/planning/cli.py, docs/scale.md)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["plan"]:
        from clipshard.planning.cli import main
        sys.exit(main(sys.argv[2:]))
    from clipshard.diagnostics.self_check import main
    sys.exit(main())
