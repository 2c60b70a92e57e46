"""The pagellm logger: one handler on the 'pagellm' root, level from PAGELLM_LOGGING_LEVEL."""

from __future__ import annotations

import logging
import sys

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        from pagellm import envs

        root = logging.getLogger("pagellm")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(envs.PAGELLM_LOGGING_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
