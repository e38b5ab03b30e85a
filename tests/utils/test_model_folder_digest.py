"""utils/identity.model_folder_digest: the digest by which a plan holds a local model folder."""

from __future__ import annotations

import shutil

from miniverl.utils import identity


def test_a_model_folders_digest_changes_with_its_weights_not_with_a_copy_or_its_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "FOLDER_DIGEST_BLOCK_BYTES", 16)  # 64 blocks of 16 bytes: a 4 KiB file is large
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = bytearray(range(256)) * 16  # 4 KiB
    (folder / "model.safetensors").write_bytes(bytes(weights))
    digest = identity.model_folder_digest(folder)
    shutil.copytree(folder, tmp_path / "copy")  # other times, other inodes: the same model
    (tmp_path / "copy" / "README.md").write_text("a model card")
    (tmp_path / "copy" / ".cache").mkdir()  # a download's bookkeeping
    assert identity.model_folder_digest(tmp_path / "copy") == digest
    weights[-1] ^= 1  # the last byte: the last block ends at the end of the file
    (folder / "model.safetensors").write_bytes(bytes(weights))
    assert identity.model_folder_digest(folder) != digest
    (folder / "model.safetensors").write_bytes(bytes(weights[:-1]))  # a size of its own
    assert identity.model_folder_digest(folder) != digest
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')  # a small file is read whole
    assert identity.model_folder_digest(folder) != digest
