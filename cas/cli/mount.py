"""``cas mount``: serve a ref or a prefix of refs read-only through FUSE."""

from __future__ import annotations

from pathlib import Path

import click

from cas.cli.app import Context, cli, pass_ctx, ref_argument
from cas.errors import CASError


@cli.command()
@ref_argument("ref")
@click.argument("mountpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--allow-other", is_flag=True, help="Let other users read the mount (needs user_allow_other)."
)
@pass_ctx
def mount(obj: Context, ref: str, mountpoint: Path, allow_other: bool) -> None:
    """Mount REF (a checkpoint, or a prefix such as runs/r1) read-only at MOUNTPOINT.

    Any program then reads the checkpoint in place: ingested files as they were, saved states
    as <key>.safetensors plus manifest.json. Every byte is verified; a corrupt chunk is an I/O
    error. Runs in the foreground until unmounted (fusermount -u MOUNTPOINT, or Ctrl-C).
    Needs the fuse extra (pip install 'cas[fuse]'), libfuse 2 and /dev/fuse.

    \b
    Example:
      cas mount runs/r1 /mnt/ckpt &  sha256sum /mnt/ckpt/checkpoint-500/model.safetensors
    """
    from cas.fs.fuse import fuse_unavailable_reason, mount_readonly

    reason = fuse_unavailable_reason()
    if reason is not None:
        raise CASError(f"cannot mount: {reason}")
    repo = obj.open(create=False, readonly=True)
    try:
        mount_readonly(repo, ref, str(mountpoint), allow_other=allow_other)
    finally:
        repo.close()
