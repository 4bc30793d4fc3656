"""Exports encrypted with age (https://age-encryption.org) for the recipients a client names
(``TrainingClient.save_weights_external(age_encryption_recipients=[...])``): each file of the
checkpoint is stored and downloaded as ``<name>.age``, readable only with an identity of one of
them (``age -d -i key.txt adapter_model.safetensors.age``). The server never holds a key that
opens them."""

from __future__ import annotations

from typing import TypeAlias

import pyrage
from pyrage import ssh, x25519

MAX_RECIPIENTS = 10  # the service's bound (protocol reference, save_weights_external)
SUFFIX = ".age"

Recipient: TypeAlias = x25519.Recipient | ssh.Recipient


def parse_recipients(values: list[str], field: str = "age_encryption_recipients") -> list[Recipient]:
    """age X25519 (``age1...``) or SSH (``ssh-ed25519 ...``, ``ssh-rsa ...``) public keys; a
    ValueError names the first that is neither, by its index in ``field``."""
    if not values:
        raise ValueError(f"{field} is empty: name at least one recipient, or leave it out for a plain export")
    if len(values) > MAX_RECIPIENTS:
        raise ValueError(f"{field} takes at most {MAX_RECIPIENTS} recipients, got {len(values)}")
    recipients: list[Recipient] = []
    for i, value in enumerate(v.strip() for v in values):
        kind = ssh if value.startswith("ssh-") else x25519
        try:
            recipients.append(kind.Recipient.from_str(value))
        except pyrage.RecipientError as e:
            raise ValueError(
                f"{field}[{i}] is not an age X25519 (age1...), ssh-ed25519 or ssh-rsa public key: {e}"
            ) from None
    return recipients


def encrypt_files(files: dict[str, bytes], recipients: list[Recipient]) -> dict[str, bytes]:
    """Each file, encrypted to every recipient, under its name + ``.age``."""
    return {name + SUFFIX: pyrage.encrypt(data, recipients) for name, data in files.items()}
