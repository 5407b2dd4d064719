"""Why a call cannot reach ``atoll syncer``: gRPC's failure text mapped to one cause, with its fix, in one table.

A failed call's details (gRPC's text: ``Hostname Verification Check failed``, ``CERTIFICATE_VERIFY_FAILED:
certificate has expired``, ``WRONG_VERSION_NUMBER``, ``Connection refused``...) are looked up in :data:`CAUSES`,
first match wins. A mistake of the settings (a server name the certificate does not carry, a CA that did not
sign it, an expired certificate, TLS to a plaintext port or plaintext to a TLS port) repeats whatever the load,
so the island ends at once with the cause's line; an address that does not answer (refused, timed out, not
resolved) may be a syncer that is starting or restarting, so the island waits, and says so. A text that names
no cause (``Socket closed``, a handshake cut short: a plaintext client at a TLS port reads only this, and so
does one whose syncer was just killed) is settled by asking the port itself (:func:`cross_check`): does it
complete a TLS handshake (Python's ``ssl``, nothing verified), or answer gRPC in plaintext?
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass

import grpc

from atoll.config.parse import parse_address

#: the causes a transport failure's text names: (name, fatal, lower-case fragments of gRPC's text), in order
CAUSES: tuple[tuple[str, bool, tuple[str, ...]], ...] = (
    ("server_name", True, ("hostname verification check failed", "is not in peer certificate",
                           "peer name", "hostname mismatch")),
    ("expired", True, ("certificate has expired",)),
    ("not_yet_valid", True, ("certificate is not yet valid",)),
    ("unknown_ca", True, ("certificate_verify_failed", "certificate verify failed", "unable to get local issuer",
                          "self signed certificate", "self-signed certificate", "unknown ca")),
    ("tls_to_plaintext", True, ("wrong_version_number", "packet_length_too_long", "http_request",
                                "record layer failure")),
    ("unreachable", False, ("connection refused", "timeout occurred", "deadline exceeded", "dns resolution failed",
                            "no route to host", "network is unreachable", "name or service not known",
                            "connect failed", "failed to connect to remote host")),
)


@dataclass(frozen=True)
class Cause:
    """Why calls to the syncer at ``address`` fail.

    Attributes:
        name: one of :data:`CAUSES`' names, or ``plaintext_to_tls`` (found by :func:`cross_check` only).
        fatal: a mistake of the settings (end the island); False: wait and try again.
        line: one line naming the setting, the cause and the fix (a fatal cause), or what is waited for.
    """

    name: str
    fatal: bool
    line: str


def classify(details: str) -> tuple[str, bool] | None:
    """(cause name, fatal) that gRPC's failure text ``details`` names (:data:`CAUSES`), or None: none."""
    text = details.lower()
    for name, fatal, fragments in CAUSES:
        if any(f in text for f in fragments):
            return name, fatal
    return None


def cross_check(address: str, plaintext: bool, timeout_s: float = 5.0) -> str | None:
    """Settle a failure whose text named no cause by asking the port at ``address`` which protocol it speaks:
    ``plaintext_to_tls`` (a ``plaintext`` client, and the port completes a TLS handshake), ``tls_to_plaintext``
    (a TLS client, and the port answers gRPC in plaintext), else None (no answer either way: transient)."""
    host, port = parse_address(address, "syncer")
    if plaintext:
        return "plaintext_to_tls" if _speaks_tls(host, port, timeout_s) else None
    with grpc.insecure_channel(address) as channel:
        try:  # a method no syncer serves: any answer but UNAVAILABLE is a gRPC server speaking plaintext
            channel.unary_unary("/atoll.Syncer/Probe")(b"", timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None):
                return None
        return "tls_to_plaintext"


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake (its certificate not checked)."""
    import socket

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host if not _is_ip(host) else None):
            return True
    except (OSError, ssl.SSLError):
        return False


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _certificate(address: str, timeout_s: float = 5.0):  # noqa: ANN202 - a cryptography x509.Certificate or None
    """The certificate the syncer at ``address`` presents (not verified), or None (no cryptography, no
    handshake)."""
    try:
        from cryptography import x509
    except ImportError:
        return None
    host, port = parse_address(address, "syncer")
    try:
        pem = ssl.get_server_certificate((host.strip("[]"), port), timeout=timeout_s)
        return x509.load_pem_x509_certificate(pem.encode())
    except (OSError, ssl.SSLError, ValueError):
        return None


def _names(cert) -> list[str]:  # noqa: ANN001 - a cryptography x509.Certificate
    """The DNS names and IP addresses ``cert`` is valid for (its subject's common name when it has none)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [*sans.get_values_for_type(x509.DNSName), *map(str, sans.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return names


def _when(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def explain(name: str, address: str, details: str, server_name: str | None = None) -> Cause:
    """The :class:`Cause` ``name`` of failures to reach the syncer at ``address`` (gRPC's text ``details``), its
    line naming what the certificate the syncer presents says where that helps (read without verifying it)."""
    host, port = parse_address(address, "syncer")
    said = details.split("last error: ")[-1].strip()[:160]
    if name == "server_name":
        cert = _certificate(address)
        dialed = server_name or host
        names = _names(cert) if cert is not None else []
        if names:
            fix = (f"dial it by a name it carries (--syncer {names[0]}:{port}) or pass --tls-server-name {names[0]}"
                   if server_name is None else f"pass --tls-server-name {names[0]}, a name it carries")
            line = (f"tls_server_name: the syncer's certificate at '{address}' is for {', '.join(names[:4])}, not "
                    f"'{dialed}'; {fix}")
        else:
            line = (f"tls_server_name: the syncer's certificate at '{address}' does not carry the name '{dialed}'; "
                    "dial it by a name its certificate carries or pass --tls-server-name with one")
        return Cause(name, True, line)
    if name in ("expired", "not_yet_valid"):
        cert = _certificate(address)
        if name == "expired":
            until = f" on {_when(cert.not_valid_after_utc)}" if cert is not None else ""
            return Cause(name, True, f"tls_cert: the syncer's certificate at '{address}' expired{until}; renew it "
                                     "(--tls-cert and --tls-key of atoll syncer) and restart the syncer")
        since = f" from {_when(cert.not_valid_before_utc)}" if cert is not None else ""
        return Cause(name, True, f"tls_cert: the syncer's certificate at '{address}' is valid only{since}; check "
                                 "the clocks of the syncer's host and this one")
    if name == "unknown_ca":
        cert = _certificate(address)
        issuer = f" (issued by {cert.issuer.rfc4514_string()})" if cert is not None else ""
        marker = "CERTIFICATE_VERIFY_FAILED: "
        reason = (details.split(marker)[-1].strip().removesuffix(": OK")[:80] if marker in details
                  else "certificate verify failed")
        return Cause(name, True, f"tls_ca: the syncer's certificate at '{address}'{issuer} is not signed by a CA "
                                 f"this island trusts ({reason}); pass --tls-ca with the CA that signed it")
    if name == "tls_to_plaintext":
        return Cause(name, True, f"plaintext: the syncer at '{address}' serves plaintext and this island spoke TLS "
                                 "to it; pass --plaintext (loopback, or with --insecure), or dial its TLS port")
    if name == "plaintext_to_tls":
        return Cause(name, True, f"plaintext: the syncer at '{address}' serves TLS and this island sent plaintext; "
                                 "drop --plaintext and pass --tls-ca with the CA that signed its certificate")
    return Cause(name, False, f"the syncer at '{address}' does not answer ({said or 'no answer'})")
