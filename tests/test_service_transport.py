"""Transport mistakes of ``atoll island``, each one line naming the cause and the fix, exit status 2, no traceback
and no gRPC log line: a server name the certificate does not carry, plaintext to a TLS port, TLS to a
plaintext port, a CA that did not sign the certificate, an expired certificate; an unreachable address is
waited for, and the island says so with the address.

The syncer here is a gRPC server in the test's process on loopback (its ports' certificates made with
``cryptography``: one CA signs them); the island is ``python -m atoll island`` in a subprocess with a timeout.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tests.conftest import run_atoll

cryptography = pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from atoll.runtime.service import diagnose  # noqa: E402

GRPC_LOG = re.compile(r"^[IWEF]\d{4} ")  # a line of gRPC's C++ log (absl's format)


def _issue(name: str, sans: list[x509.GeneralName], issuer: tuple | None = None, ca: bool = False,
           start_days: float = 0.0, days: float = 2.0) -> tuple:
    """(key, certificate) for ``name`` with the names ``sans``, signed by ``issuer`` (key, cert) or itself."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer, issuer_name = (issuer[0], issuer[1].subject) if issuer else (key, subject)
    start = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=start_days, minutes=-5)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(start)
               .not_valid_after(start + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), False)
    return key, builder.sign(signer, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pair(pair: tuple) -> tuple[bytes, bytes]:
    key = pair[0].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key, _pem(pair[1])


LOOPBACK = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


@pytest.fixture(scope="module")
def syncer_ports(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (ports by kind, folder of files)
    """Loopback gRPC servers (no handlers: the mistakes end at the handshake): ``good`` (a certificate for
    localhost and 127.0.0.1), ``named`` (for syncer.example.org only), ``expired`` (all three signed by one CA,
    whose PEM is ``ca.pem``; ``other_ca.pem`` signed none), and ``plain`` (no TLS); ``closed``: a port nothing
    listens on."""
    folder = tmp_path_factory.mktemp("transport")
    ca = _issue("atoll test CA", [], ca=True, days=30)
    other = _issue("another CA", [], ca=True, days=30)
    (folder / "ca.pem").write_bytes(_pem(ca[1]))
    (folder / "other_ca.pem").write_bytes(_pem(other[1]))
    (folder / "island_0.token").write_text("a" * 32)
    certs = {"good": _issue("localhost", LOOPBACK, ca), "named": _issue("syncer", [x509.DNSName(
        "syncer.example.org")], ca), "expired": _issue("localhost", LOOPBACK, ca, start_days=-10, days=1)}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ports = {kind: server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([_pair(pair)]))
             for kind, pair in certs.items()}
    ports["plain"] = server.add_insecure_port("127.0.0.1:0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ports["closed"] = s.getsockname()[1]
    server.start()
    yield ports, folder
    server.stop(grace=0).wait()


def _island(fast_config: dict, folder: Path, port: int, *flags: str, timeout: float = 120):  # noqa: ANN202
    """``python -m atoll island`` against 127.0.0.1:``port`` (with ``flags``), its result."""
    run = ["--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], "--model", "micro",
           "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--islands", "2", "--steps", "10",
           "--sync-every", "5", "--fragments", "2", "--threads", "1", "--no-progress"]
    return run_atoll("island", "--syncer", f"127.0.0.1:{port}", "--island", "0", "--credential",
                     str(folder / "island_0.token"), *flags, *run, timeout=timeout)


CASES = {  # mistake: (port, flags (ca: the folder's file), the line's field, words of its cause and fix)
    "wrong server name": ("named", ["--tls-ca", "ca.pem"], "tls_server_name",
                          ["syncer.example.org", "not '127.0.0.1'", "--tls-server-name syncer.example.org"]),
    "plaintext to the TLS port": ("good", ["--plaintext"], "plaintext", ["serves TLS", "drop --plaintext"]),
    "TLS to a plaintext port": ("plain", ["--tls-ca", "ca.pem"], "plaintext", ["serves plaintext",
                                                                              "pass --plaintext"]),
    "a CA that did not sign it": ("good", ["--tls-ca", "other_ca.pem"], "tls_ca",
                                  ["CN=atoll test CA", "pass --tls-ca with the CA that signed it"]),
    "an expired certificate": ("expired", ["--tls-ca", "ca.pem"], "tls_cert", ["expired on", "renew it"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(CASES))
def test_a_transport_mistake_is_one_line_and_exit_2(mistake: str, syncer_ports, fast_config: dict) -> None:  # noqa: ANN001
    ports, folder = syncer_ports
    port, flags, field, words = CASES[mistake]
    flags = [str(folder / f) if f.endswith(".pem") else f for f in flags]
    result = _island(fast_config, folder, ports[port], *flags)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (mistake, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"atoll: error: {field}:"), (mistake, lines)
    assert f"127.0.0.1:{ports[port]}" in lines[0] and all(w in lines[0] for w in words), (mistake, lines[0])
    assert "Traceback" not in result.stdout + result.stderr
    assert not [x for x in (result.stdout + result.stderr).splitlines() if GRPC_LOG.match(x)]


@pytest.mark.slow
def test_an_unreachable_syncer_is_waited_for_with_a_line_naming_it(syncer_ports, fast_config: dict) -> None:  # noqa: ANN001
    """Nothing listens at the address: the island retries, says within its first 10-30 s that it waits (with
    the address), and ends after --give-up-s with one line and status 1."""
    ports, folder = syncer_ports
    address = f"127.0.0.1:{ports['closed']}"
    result = _island(fast_config, folder, ports["closed"], "--plaintext", "--give-up-s", "12")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert lines[0].startswith(f"atoll: waiting for the syncer at '{address}'") and "Connection refused" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("atoll: error: syncer: no answer from"), lines
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(("details", "cause"), [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:40789: Custom verification check "
     "failed with error: UNAUTHENTICATED: Hostname Verification Check failed.", ("server_name", True)),
    ("Peer name 10.0.0.2 is not in peer certificate", ("server_name", True)),
    ("last error: UNKNOWN: ipv4:127.0.0.1:44201: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
     "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has expired: OK",
     ("expired", True)),
    ("last error: UNKNOWN: ipv4:127.0.0.1:41199: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
     "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
     "certificate: OK", ("unknown_ca", True)),
    ("last error: UNKNOWN: ipv4:127.0.0.1:43675: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
     "error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification "
     "context: OK", ("tls_to_plaintext", True)),
    ("last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
     ("unreachable", False)),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.2:7070: Timeout occurred: FD Shutdown",
     ("unreachable", False)),
    ("Deadline Exceeded", ("unreachable", False)),
    # a plaintext client at a TLS port, or a syncer just killed: settled by asking the port
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:41199: Socket closed", None),
    ("last error: UNKNOWN: ipv4:10.0.0.2:7070: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SYSCALL: "
     "Handshake read failed", None),
])
def test_failure_texts_map_to_one_cause(details: str, cause: tuple[str, bool] | None) -> None:
    assert diagnose.classify(details) == cause


@pytest.mark.slow
def test_a_port_is_asked_which_protocol_it_speaks(syncer_ports) -> None:  # noqa: ANN001
    ports, _ = syncer_ports
    assert diagnose.cross_check(f"127.0.0.1:{ports['good']}", plaintext=True) == "plaintext_to_tls"
    assert diagnose.cross_check(f"127.0.0.1:{ports['plain']}", plaintext=False) == "tls_to_plaintext"
    assert diagnose.cross_check(f"127.0.0.1:{ports['plain']}", plaintext=True) is None
    assert diagnose.cross_check(f"127.0.0.1:{ports['closed']}", plaintext=False) is None
    assert diagnose.cross_check(f"127.0.0.1:{ports['closed']}", plaintext=True) is None


def test_a_peer_failure_keeps_the_end_of_the_backends_text() -> None:
    """gloo's long text ends with the cause; cut to one line, its end stays (not "... closed by pee")."""
    from atoll.runtime.collective.failure import backend_reason

    text = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40120: " + "x" * 150
            + " Connection closed by peer [127.0.0.1]:45678")
    reason = backend_reason(RuntimeError(text))
    assert reason.endswith("Connection closed by peer [127.0.0.1]:45678") and len(reason) <= 160, reason


@pytest.mark.slow
def test_a_sigtermed_island_says_so_and_leaves_the_syncer(fast_config: dict, tmp_path: Path) -> None:
    """SIGTERM to a training island: one line, ``Leave`` (the syncer lists it as left), status 143."""
    import signal

    from tests.conftest import free_port
    from tests.test_service import run_flags, start, status, wait_all, wait_for

    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config, steps=400)
    procs = [start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags], tmp_path / "syncer.log")]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        procs += [start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", str(i),
                         "--credential", str(out / "credentials" / f"island_{i}.token"), *flags],
                        tmp_path / f"island_{i}.log") for i in range(2)]
        wait_for("a commit", lambda: status(out).get("commits", 0) > 0, procs, timeout=300)
        procs[1].send_signal(signal.SIGTERM)
        assert wait_all([procs[1]], timeout=120) == [143], (tmp_path / "island_0.log").read_text()[-2000:]
        wait_for("island 0 left", lambda: 0 in status(out).get("left", []), [procs[0]], timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        wait_all(procs, timeout=60)
    lines = [x for x in (tmp_path / "island_0.log").read_text().splitlines() if "SIGTERM" in x]
    assert len(lines) == 1 and lines[0].startswith("atoll island 0: SIGTERM: stopped after"), lines
    assert "Traceback" not in (tmp_path / "island_0.log").read_text()
