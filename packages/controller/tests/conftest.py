"""Fixtures of the controller tests."""

from __future__ import annotations

import socket

import pytest

LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture
def network_guard(monkeypatch):
    """Refuses, and records, every connection or name lookup in this process that is not
    local (unix sockets and loopback pass). The test asserts the returned list is empty."""
    attempts: list[tuple[str, object]] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family == socket.AF_UNIX or (
            isinstance(address, tuple) and address[0] in LOCAL_HOSTS
        ):
            return real_connect(sock, address)
        attempts.append(("connect", address))
        raise OSError(f"test: network access refused ({address})")

    def getaddrinfo(host, *args, **kwargs):
        if host is None or (host.decode() if isinstance(host, bytes) else host) in LOCAL_HOSTS:
            return real_getaddrinfo(host, *args, **kwargs)
        attempts.append(("getaddrinfo", host))
        raise socket.gaierror(f"test: name lookup refused ({host})")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts
