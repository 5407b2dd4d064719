"""TLS material for ``atoll syncer`` and ``atoll island``: read and checked once, with one-line errors.

The certificate and key are the user's (a CA's, or a self-signed pair an island trusts with ``--tls-ca``).
They are checked with ``cryptography`` where it is installed (it comes with Ray): PEM that parses, a key
that matches the certificate; else only that the files read and look like PEM. gRPC's own TLS (BoringSSL)
does the rest.
"""

from __future__ import annotations

from pathlib import Path

from atoll.errors import ConfigError


def _read(path: Path, field: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{field}: cannot read '{path}' ({e.strerror or e}); pass the path of a PEM file") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{field}: '{path}' is not PEM (no '-----BEGIN' line); pass a PEM file")
    return data


def _crypto():  # noqa: ANN202 - the module or None
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        return None
    return x509, serialization


def read_certificate(path: Path, field: str) -> bytes:
    """The PEM bytes of one or more X.509 certificates at ``path``.

    Raises:
        ConfigError: unreadable, or not PEM certificates (one line naming ``field``).
    """
    data = _read(path, field)
    crypto = _crypto()
    if crypto is not None:
        try:
            crypto[0].load_pem_x509_certificates(data)
        except ValueError:
            raise ConfigError(f"{field}: '{path}' holds no readable PEM certificate; pass a certificate "
                              "(-----BEGIN CERTIFICATE-----)") from None
    return data


def read_key_pair(cert: Path, key: Path) -> tuple[bytes, bytes]:
    """(private key PEM, certificate chain PEM) of the syncer, the key checked against the certificate.

    Raises:
        ConfigError: either file unreadable or malformed, an encrypted key, or a key that is not the
            certificate's.
    """
    cert_pem = read_certificate(cert, "tls_cert")
    key_pem = _read(key, "tls_key")
    crypto = _crypto()
    if crypto is not None:
        x509, serialization = crypto
        try:
            private = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError):
            raise ConfigError(f"tls_key: '{key}' is not an unencrypted PEM private key; pass the certificate's "
                              "key (decrypt it with openssl pkey)") from None
        leaf = x509.load_pem_x509_certificates(cert_pem)[0]
        raw = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        if private.public_key().public_bytes(*raw) != leaf.public_key().public_bytes(*raw):
            raise ConfigError(f"tls_key: '{key}' is not the key of the certificate '{cert}'; pass the matching pair")
    return key_pem, cert_pem


def loopback_certificate(days: float = 1.0) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM) of a fresh self-signed certificate for ``localhost`` and 127.0.0.1
    (an ECDSA P-256 key; the certificate is its own CA, valid from 5 minutes ago for ``days`` days): for tests
    and loopback benchmarks, never for a syncer that other hosts dial.

    Raises:
        ImportError: ``cryptography`` is not installed (it comes with Ray and the ``dev`` extra).
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))
