"""grpo_ds.distributed.launcher: the master port a launch is given."""

import socket

from grpo_ds.distributed import launcher


def test_a_free_port_comes_with_the_next_one_free_below_the_ephemeral_range():
    """A split launch binds MASTER_PORT and MASTER_PORT + 1 (its bridge's store), so both must be
    free; drawn below the ephemeral range, neither can be taken meanwhile by a socket bound to port
    0."""
    ephemeral_low = int(launcher._EPHEMERAL_RANGE.read_text().split()[0])
    ports = [launcher.free_port() for _ in range(20)]
    assert len(set(ports)) > 10, ports  # drawn at random, not one fixed port
    for port in ports:
        assert 1024 <= port and port + 1 < ephemeral_low, (port, ephemeral_low)
        for each in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", each))


def test_with_no_free_pair_below_the_range_the_kernel_picks(monkeypatch):
    """Where no pair below the ephemeral range is free, the port is one the kernel gives (from that
    range), and it is free."""
    monkeypatch.setattr(launcher, "_bindable", lambda port: False)
    port = launcher.free_port()
    assert port >= int(launcher._EPHEMERAL_RANGE.read_text().split()[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
