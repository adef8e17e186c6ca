"""``python -m pgqueue.tools.bench``: the same as ``pgqueue bench``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
