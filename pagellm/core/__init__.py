"""Engine-core side: protocol, engine core, scheduler, KV cache. Imports nothing heavy:
the frontend's prestart reads the stop signal from here before torch loads."""

import signal

ENGINE_STOP_SIGNAL = signal.SIGUSR1
"""How a frontend tells its engine-core process to stop (`stop_engine_process` in
pagellm/engine/prestart.py). Engine cores ignore SIGTERM and SIGINT and run in a session
of their own: a stop meant for the whole program (Ctrl-C, `kill -- -PGID`, systemd
stopping the service's control group) is the frontend's to handle, which drains its
requests first and then stops its cores."""
