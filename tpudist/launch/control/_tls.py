"""The control server's certificate when agents dial it over the network (`--ray`), not an SSH tunnel.

Each job makes a fresh key and a self-signed certificate for the name `TLS_NAME`; the certificate
reaches every agent in its bootstrap, and the agent trusts that certificate alone. The channel is
then encrypted and the launcher authenticated, and the job token (checked on every call) still
authenticates the agents.

    key_pem, cert_pem = self_signed()
"""

from __future__ import annotations

import datetime

from tpudist.launch.control import TLS_NAME


def self_signed(days: int = 30) -> tuple[bytes, bytes]:
    """A new P-256 key and a certificate for TLS_NAME signed by it, both PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)
