"""The CLI's shared machinery: the root group, store option, error handling, JSON and progress."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import click
from click.shell_completion import CompletionItem

from cas.errors import CASError

EXIT_PROBLEM = 1
EXIT_USAGE = 2


@dataclass
class Context:
    """What every command receives: the store URL and output preferences.

    ``store`` and ``endpoint_url`` are what the command line or the environment gave; the
    user's config file (``cas.cli.settings``) fills in what they leave out.
    """

    store: str | None
    endpoint_url: str | None
    quiet: bool
    _config: Any = None

    def user_config(self) -> Any:
        """The user's config file, read once (an empty config when there is none)."""
        if self._config is None:
            from cas.cli.settings import load_user_config

            self._config = load_user_config()
        return self._config

    def store_url(self) -> str | None:
        """``--store`` / ``CAS_STORE``, else the config's ``core.store``, else None (the
        default location)."""
        if self.store:
            return self.store
        configured: str | None = self.user_config().core.get("store")
        return os.path.expanduser(configured) if configured else None

    def open(self, *, create: bool = True, readonly: bool = False) -> Any:
        """Open the ``--store`` store (imported lazily so ``cas --help`` stays fast)."""
        return self.open_url(self.store_url(), create=create, readonly=readonly)

    def open_url(self, url: str | None, endpoint_url: str | None = None, **kw: Any) -> Any:
        """Open a store by URL (None: the default). ``endpoint_url`` (a remote's own), else
        ``--endpoint-url`` / ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else the config's,
        applies to S3 URLs only."""
        from cas.repo.opening import open as open_store

        options: dict[str, Any] = {}
        endpoint = endpoint_url or self.endpoint_url
        if endpoint is None and (url or "").startswith(("s3://", "s3a://")):
            endpoint = self.user_config().core.get("endpoint_url")
        # Only S3 stores take an endpoint (a local one would fail).
        if endpoint and (url or "").startswith(("s3://", "s3a://")):
            options["endpoint_url"] = endpoint
        return open_store(url, **kw, **options)

    def remote(self, spec: str, local: Any = None) -> Any:
        """The ``Remote`` that ``--to`` / ``--from`` SPEC names: a remote of the store
        ``local`` (if given), else of the user's config, else SPEC itself as a URL or path.
        A remote's name wins over a directory of the same name (write ``./NAME`` for that)."""
        from cas.cli.settings import Remote, is_remote_name, store_remotes

        if is_remote_name(spec):
            if local is not None:
                found = store_remotes(local.config.extra).get(spec)
                if found is not None:
                    return found
            found = self.user_config().remotes.get(spec)
            if found is not None:
                return found
        return Remote(spec, spec, None, "url")

    def open_remote(self, spec: str, local: Any = None, **kw: Any) -> Any:
        """Open the store ``spec`` names (a remote's name, a URL or a path)."""
        remote = self.remote(spec, local)
        return self.open_url(remote.url, remote.endpoint_url, **kw)


GLOBAL_VALUE_OPTIONS = ("--store", "--endpoint-url")
"""Global options that take a value; accepted before or after the command name."""
GLOBAL_FLAGS = ("-q", "--quiet")


def hoist_global_options(group: click.Group, args: Sequence[str]) -> list[str]:
    """``args`` with the global options found after the command name moved in front of it,
    so ``cas push REF --to URL --endpoint-url E`` means ``cas --endpoint-url E push ...``.

    The command's own options are walked with their arity, so an option's value that happens to
    read ``-q`` stays where it is; everything after ``--`` is left alone.
    """
    front: list[str] = []
    tail: list[str] = []
    args = list(args)
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":  # the root's own
        front.append(args[i])
        if args[i] in GLOBAL_VALUE_OPTIONS and i + 1 < len(args):
            front.append(args[i + 1])
            i += 1
        i += 1
    command: click.Command | None = group
    while i < len(args):
        token = args[i]
        if token == "--":
            tail.extend(args[i:])
            break
        if token in GLOBAL_VALUE_OPTIONS and i + 1 < len(args):
            front.extend(args[i : i + 2])
            i += 2
            continue
        if token in GLOBAL_FLAGS or token.split("=", 1)[0] in GLOBAL_VALUE_OPTIONS:
            front.append(token)
        elif not token.startswith("-") or token == "-":
            if isinstance(command, click.Group):  # a (sub)command name: walk into it
                command = command.commands.get(token)
            tail.append(token)
        else:
            tail.append(token)
            if _takes_value(command, token) and i + 1 < len(args):
                tail.append(args[i + 1])
                i += 1
        i += 1
    return front + tail


def _takes_value(command: click.Command | None, token: str) -> bool:
    """Whether ``token`` is an option of ``command`` whose value is the next argument."""
    if command is None or "=" in token:
        return False
    for param in command.params:
        if isinstance(param, click.Option) and token in (*param.opts, *param.secondary_opts):
            return not (param.is_flag or param.count)
    return False


def json_wanted(args: Sequence[str]) -> bool:
    """Whether the command line asks for ``--json`` (then errors are JSON too)."""
    head = list(args)[: list(args).index("--")] if "--" in args else list(args)
    return "--json" in head


class CASGroup(click.Group):
    """Turns cas errors, OS errors and usage errors into one line on stderr and a non-zero exit
    (one JSON object with ``--json``), and takes global options after the command name too."""

    json_errors = False

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Global options are hoisted in front of the command before click parses them."""
        if ctx.parent is None:  # shell completion parses this way too: `cas ls --store X r<Tab>`
            args = hoist_global_options(self, args)
        return super().parse_args(ctx, args)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        parent = super().main
        CASGroup.json_errors = json_wanted(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return parent(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = parent(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.stdout.flush()  # here, where a reader gone away can still be told apart
        except BrokenPipeError:
            _stop_quietly()
        except click.exceptions.NoArgsIsHelpError as e:  # bare `cas` asks for the help
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.UsageError as e:  # one line, not click's usage block
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            _fail(f"{e.format_message()}{hint}", code=EXIT_USAGE, kind=type(e).__name__)
        except click.ClickException as e:
            _fail(e.format_message(), code=e.exit_code, kind=type(e).__name__)
        except click.Abort:
            _fail("aborted", code=130, kind="Aborted")
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CASError as e:
            _fail(f"{type(e).__name__}: {e}", kind=type(e).__name__)
        except BrokenPipeError:  # an OSError, but no failure: `cas ls | head -1`
            _stop_quietly()
        except OSError as e:  # a missing file, no permission, a full or read-only disk...
            text = f"{type(e).__name__}: {e.strerror or e}: {e.filename or ''}".rstrip(": ")
            _fail(text, kind=type(e).__name__)
        except KeyboardInterrupt:
            _fail("interrupted", code=130, kind="Interrupted")


def _stop_quietly() -> NoReturn:
    """The reader of stdout went away (``cas ls | head -1``): stop with status 0 and no message.

    stdout then points at /dev/null, so the interpreter's last flush of what is still buffered
    has nowhere to fail.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(0)


def warn_damaged(damaged: Iterable[object]) -> None:
    """One ``cas: warning:`` line on stderr per damaged ref a listing left out or could not
    describe; a listing shows everything else and still exits 0."""
    for item in damaged:
        text = str(item).splitlines()[0] if str(item) else "damaged"
        click.echo(f"cas: warning: cannot read {text}", err=True)


def require_refs(repo: Any, selectors: Iterable[str]) -> None:
    """NothingSelected for the first selector that picks no ref: a mistyped name must fail,
    not pass as an empty, successful selection."""
    from cas.errors import NothingSelected

    for selector in selectors:
        if selector and not repo.ref_names(selector):
            raise NothingSelected(f"no ref matches {selector!r} (see `cas ls`)")


def _fail(message: str, code: int = EXIT_PROBLEM, kind: str = "Error") -> NoReturn:
    """Report a failure on stderr (one line, or one JSON object under ``--json``) and exit."""
    line = message.splitlines()[0] if message else "failed"
    if CASGroup.json_errors:
        # A script parses stderr too: the type without its "Name: " prefix in the message.
        text = line.removeprefix(f"{kind}: ")
        click.echo(json.dumps({"error": text, "type": kind, "exit_code": code}), err=True)
    else:
        click.echo(f"cas: error: {line}", err=True)
    sys.exit(code)


@click.group(
    cls=CASGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option(
    "--store",
    envvar="CAS_STORE",
    metavar="URL",
    help="Store location: a path, file://, s3://bucket/prefix or any fsspec URL "
    "[env CAS_STORE; default ~/.local/share/cas/store].",
)
@click.option(
    "--endpoint-url",
    envvar=["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"],
    metavar="URL",
    help="S3-compatible endpoint [env AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL].",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress bars [env CAS_PROGRESS: 1 shows them even when stderr is not a terminal, "
    "0 hides them].",
)
@click.version_option(None, "-V", "--version", package_name="cas")
@click.pass_context
def cli(ctx: click.Context, store: str | None, endpoint_url: str | None, quiet: bool) -> None:
    """cas: a content-addressed checkpoint store.

    Checkpoints are stored as chunks keyed by blake3, named by refs such as
    runs/20260115_143022_a1b2c3d4/phase2/ckpt_phase2_step00045000. Identical tensors are stored
    once, copies cost nothing, and every byte read back is verified.

    \b
    Examples:
      cas put checkpoint-500/ runs/r1/checkpoint-500     ingest an HF checkpoint directory
      cas get runs/r1/checkpoint-500 restored/ --sha256   write it back byte-identical
      cas ls runs/r1 --json                                list refs for scripts
      cas cp runs/r1/ckpt_step00045000 runs/r1/gates/bc_best   a gate copy: writes no chunk
      cas verify --full                                    re-hash every chunk

    \b
    Progress bars go to stderr when it is a terminal; CAS_PROGRESS=1 shows them anyway
    (a CI log), CAS_PROGRESS=0 or -q hides them. Shell completion, ref names included:
      eval "$(cas completion bash)"      (zsh, fish: see `cas completion --help`)
    """
    quiet = quiet or progress_hidden(sys.stderr.isatty(), os.environ.get("CAS_PROGRESS"))
    ctx.obj = Context(store, endpoint_url, quiet)


def progress_hidden(stderr_is_terminal: bool, setting: str | None) -> bool:
    """Whether progress bars stay hidden: ``CAS_PROGRESS`` 1 or 0 decides, else whether
    stderr is a terminal."""
    if setting in ("0", "1"):
        return setting == "0"
    return not stderr_is_terminal


def complete_refs(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Shell completion of a REF argument: the names of the store's refs that start with what
    was typed (the store from ``--store`` or ``CAS_STORE``; nothing if it cannot be opened)."""
    params = ctx.find_root().params
    store = params.get("store") or os.environ.get("CAS_STORE")
    endpoint = (
        params.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    try:
        repo = Context(store, endpoint, True).open_url(store, create=False, readonly=True)
        names = repo.ref_names()
    except Exception:  # a completion must never print a traceback into the user's prompt
        return []
    return [CompletionItem(name) for name in names if name.startswith(incomplete)]


def ref_argument(name: str, **kwargs: Any) -> Callable[[Any], Any]:
    """``click.argument`` for a ref name (or selector), completed with the store's ref names."""
    return click.argument(name, shell_complete=complete_refs, **kwargs)


pass_ctx = click.make_pass_decorator(Context)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def emit_json(value: Any) -> None:
    """Print one JSON document on stdout."""
    click.echo(json.dumps(_finite(value), indent=2, default=_json_default, allow_nan=False))


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as null: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "__dict__"):
        return value.__dict__
    return str(value)


def byte_bar(obj: Context, total: int | None, desc: str) -> Any:
    """A tqdm byte counter on stderr (silent with --quiet or when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        # Binary units like every other size cas prints: with a divisor of 1024, tqdm's "B" would
        # label mebibytes "MB"; "iB" gives "MiB" (and "kiB").
        unit="iB",
        unit_scale=True,
        unit_divisor=1024,
        disable=obj.quiet,
        file=sys.stderr,
        leave=False,
    )


@contextmanager
def progress_bar(obj: Context, total: int | None, desc: str) -> Iterator[Callable[[int], None]]:
    """``byte_bar`` as a plain ``update(nbytes)`` callback."""
    with byte_bar(obj, total, desc) as bar:
        yield bar.update


def utc_time(ts: float) -> str:
    """A timestamp as ``2026-01-15 14:30:22`` (UTC), as listings print it."""
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="cas")
