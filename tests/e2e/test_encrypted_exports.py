"""``save_weights_external(age_encryption_recipients=[...])`` through the real SDK: every file
of the export is downloaded as ``<name>.age``, opens with any recipient's identity (an age
X25519 key, an SSH ed25519 key) into exactly the bytes of the same export unencrypted, and with
no other key; recipients that are not keys are refused by index."""

from __future__ import annotations

import httpx
import pyrage
import pytest
import tinker
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pyrage import ssh, x25519
from tinker import types

from tests.support.server import ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def download(rest: tinker.RestClient, path: str) -> dict[str, bytes]:
    urls = rest.get_external_weights_urls(path).result().urls
    return {name: httpx.get(url, timeout=60).raise_for_status().content for name, url in urls.items()}


def ssh_key() -> tuple[str, ssh.Identity]:
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    return public.decode(), ssh.Identity.from_buffer(private)


def test_an_encrypted_export_opens_with_each_recipients_key_only(base_url: str) -> None:
    age_key, (ssh_public, ssh_identity), stranger = x25519.Identity.generate(), ssh_key(), x25519.Identity.generate()
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(10, 30))),
            loss_fn_inputs={"target_tokens": list(range(11, 31)), "weights": [1.0] * 20},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        plain = tc.save_weights_external("plain").result()
        recipients = [str(age_key.to_public()), f"  {ssh_public}\n"]  # as pasted from a file
        sealed = tc.save_weights_external("sealed", age_encryption_recipients=recipients)
        sealed = sealed.result()
        with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[1\]"):
            tc.save_weights_external("bad", age_encryption_recipients=[str(age_key.to_public()), "age1nope"]).result()
        with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients is empty"):
            tc.save_weights_external("none", age_encryption_recipients=[]).result()  # never a plain export by mistake
        tc.forward_backward([datum], "cross_entropy").result()  # the refusals used their seq_ids up; on we go

    rest = tinker.RestClient(base_url=base_url)
    clear, encrypted = download(rest, plain.path), download(rest, sealed.path)
    assert sorted(encrypted) == sorted(f"{name}.age" for name in clear) and "adapter_model.safetensors" in clear
    for name, data in clear.items():
        assert encrypted[f"{name}.age"] != data
        for identity in (age_key, ssh_identity):
            assert pyrage.decrypt(encrypted[f"{name}.age"], [identity]) == data
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(encrypted[f"{name}.age"], [stranger])
    run_id = sealed.path.removeprefix("tinker://").split("/")[0]
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert listed[sealed.path].size_bytes == sum(len(d) for d in encrypted.values())  # what is stored
