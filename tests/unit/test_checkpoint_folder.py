"""A save folder's bookkeeping: which checkpoints ``keep_last`` deletes after a save, and
publishing a checkpoint (fsynced, then renamed, then ``latest``)."""

from __future__ import annotations

import json
import os

from dapo_megatron.actor.checkpoint import (
    checkpoint_dir,
    list_checkpoints,
    point_latest_at,
    prune_checkpoints,
    publish_checkpoint,
)


def _checkpoints(save_dir, *steps):
    for step in steps:
        folder = checkpoint_dir(save_dir, step)
        folder.mkdir(parents=True)
        (folder / "metadata.json").write_text("{}")


def test_keep_last_never_deletes_the_checkpoint_just_published(tmp_path):
    """Saving step 10 beside step 50 (a folder another run wrote later steps into) with
    keep_last=1 keeps step 10; only checkpoints older than the new one are counted."""
    _checkpoints(tmp_path, 50)
    _checkpoints(tmp_path, 10)
    prune_checkpoints(tmp_path, checkpoint_dir(tmp_path, 10), keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000050"]


def test_keep_last_deletes_the_oldest_beyond_the_count(tmp_path):
    _checkpoints(tmp_path, 1, 2, 3, 4)
    prune_checkpoints(tmp_path, checkpoint_dir(tmp_path, 4), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    prune_checkpoints(tmp_path, checkpoint_dir(tmp_path, 4), keep_last=0)  # 0 keeps every one
    assert len(list_checkpoints(tmp_path)) == 2


def test_publishing_fsyncs_the_files_and_folders_before_the_renames(tmp_path, monkeypatch):
    """Every file of the staged checkpoint and its folder are fsynced before the rename
    that publishes it, and ``latest``'s new text before it replaces the old one."""
    staging = tmp_path / "step_00000003.tmp"
    (staging / "sub").mkdir(parents=True)
    (staging / "__0_0.distcp").write_bytes(b"shard")
    (staging / "sub" / "common.pt").write_bytes(b"common")
    synced, events = [], []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", str(src), list(synced)))
        return real_replace(src, dst, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", str(src), list(synced)))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    final = checkpoint_dir(tmp_path, 3)
    publish_checkpoint(staging, final)
    point_latest_at(tmp_path, final, 3)
    (kind, source, before), (kind2, source2, before2) = events
    assert kind == "rename" and source == str(staging)
    assert {
        str(staging / "__0_0.distcp"),
        str(staging / "sub" / "common.pt"),
        str(staging),
        str(staging / "sub"),
    } <= set(before)
    assert kind2 == "replace" and source2.endswith("latest.tmp") and source2 in before2
    assert str(tmp_path) in before2  # the folder that holds the renamed checkpoint
    assert synced[-1] == str(tmp_path)  # and the folder again after latest was replaced
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 3, "path": "step_00000003"}
