"""The island's client of the syncer service: which failed TLS handshakes stop an island (a protocol error
the TLS library reports: a wrong CA, a plaintext port) and which are retried (a handshake cut short on a busy
host). The texts are gRPC's own, as it reports them (grpcio 1.x, BoringSSL)."""

from __future__ import annotations

import pytest

from atoll.runtime.service.client import is_tls_protocol_error

WRONG_CA = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:34133: Tls handshake failed "
            "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
            "CERTIFICATE_VERIFY_FAILED: self signed certificate")
PLAINTEXT_PORT = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:46485: Tls handshake "
                  "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
                  "WRONG_VERSION_NUMBER")
CUT_SHORT = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.2:7070: Tls handshake failed "
             "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SYSCALL: Handshake read failed")
TIMED_OUT = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.2:7070: Timeout occurred: FD Shutdown"


@pytest.mark.parametrize(("details", "fatal"), [(WRONG_CA, True), (PLAINTEXT_PORT, True), (CUT_SHORT, False),
                                                (TIMED_OUT, False), ("Socket closed", False)])
def test_only_tls_protocol_errors_stop_an_island(details: str, fatal: bool) -> None:
    assert is_tls_protocol_error(details) is fatal
