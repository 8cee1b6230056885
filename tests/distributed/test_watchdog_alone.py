"""A rank's watchdog (exactrl/distributed/heartbeat.py) under a plain torchrun, without exactrl's launcher: when it
finds a peer gone it must still print its one line and end the rank (a rank left in a collective waits 30 minutes).
Its stop must not be threading.Thread's own `_stop`, which CPython calls at join and after a fork."""

from __future__ import annotations

import threading

from exactrl.distributed import heartbeat


def test_a_watchdog_without_exactrls_launcher_says_its_line_and_ends_the_rank(monkeypatch, capsys):
    monkeypatch.delenv(heartbeat.RANK_ERRORS_ENV, raising=False)  # a plain torchrun: no launcher's folder
    exits: list[int] = []
    monkeypatch.setattr(heartbeat.os, "_exit", exits.append)
    w = heartbeat.Watchdog(0, 2, "127.0.0.1", 1)
    monkeypatch.setattr(
        w, "run", lambda: w._halt("rank 1 (node-b) stopped answering for 15 s; rank 0 stopped")
    )
    monkeypatch.setattr(heartbeat, "_watchdog", w)
    w.start()
    w.join(10)
    assert exits == [1]  # it reached its exit (joining itself had raised before, so the rank went on waiting)
    assert "exactrl: rank 1 (node-b) stopped answering for 15 s; rank 0 stopped" in capsys.readouterr().err
    # A finished watchdog is a finished thread: threading's own bookkeeping still works on it.
    assert not w.is_alive() and w not in threading.enumerate()
