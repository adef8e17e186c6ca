"""``python -m pgqueue``: the ``pgqueue`` command without the console script on PATH
(how ``pgqueue worker --processes N`` starts its children)."""

from __future__ import annotations

import pgqueue.cli

if __name__ == "__main__":
    raise SystemExit(pgqueue.cli.main())
