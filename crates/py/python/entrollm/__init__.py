"""entrollm from Python: the command line's commands as functions.

Each function runs the command of the same name in this process (the Rust library the `entrollm`
binary is built from), so it writes the same bytes and prints the same messages and progress bars.
Keyword arguments are the command's options, spelled with underscores: ``coding_file="c.json"``
is ``--coding-file c.json``, ``overwrite=True`` is ``--overwrite``; ``False`` and ``None`` leave an
option out; a list repeats it. A failed command raises :class:`EntrollmError` with the command's
message; options the command does not know raise ``ValueError`` with its usage text.

    import entrollm
    entrollm.compress("model-dir", output="model.entrollm")
    entrollm.inspect("model.entrollm")          # the table inspect prints, as a dict
    entrollm.decompress("model.entrollm", output="restored")

docs/python.md has the functions and their options.
"""

import json
import os
import sys
import tempfile

from ._native import EntrollmError, __version__, cli

__all__ = ["EntrollmError", "__version__", "cli", "compress", "decompress", "inspect", "tune",
           "plan", "run", "synth", "command"]


def _flags(options):
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [flag, os.fspath(v) if isinstance(v, os.PathLike) else str(v)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


def command(name, *positional, **options):
    """Runs ``entrollm NAME POSITIONAL… --OPTION VALUE…`` in this process."""
    cli([name, *(os.fspath(p) for p in positional), *_flags(options)])


def compress(src, output, **options):
    """``entrollm compress SRC -o OUTPUT``: code a checkpoint (a Hugging Face directory or
    .safetensors file, or a GGUF) into a container; ``bits=4`` codes it lossily, ``budget="8GB"``
    in the forms a plan chooses."""
    command("compress", src, output=output, **options)


def decompress(container, output, **options):
    """``entrollm decompress CONTAINER -o OUTPUT``: rebuild the source bit for bit."""
    command("decompress", container, output=output, **options)


def synth(output, **options):
    """``entrollm synth -o OUTPUT``: write a synthetic checkpoint (``shape="tiny"``)."""
    command("synth", output=output, **options)


def tune(model, output, **options):
    """``entrollm tune MODEL -o OUTPUT``: time every launch's forms on this device."""
    command("tune", model, output=output, **options)


def plan(tune_file, **options):
    """``entrollm plan TUNE``: choose a form per launch under ``budget``."""
    command("plan", tune_file, **options)


def run(model, prompt, **options):
    """``entrollm run MODEL --prompt PROMPT``: generate text (printed as it streams)."""
    command("run", model, prompt=prompt, **options)


def inspect(path, **options):
    """``entrollm inspect PATH --json``, returned as a dict (per-tensor sizes, entropies, codings)."""
    with tempfile.TemporaryFile(mode="w+b") as out:
        # The command prints its JSON on stdout (file descriptor 1): capture that descriptor,
        # which the Rust side writes to, not sys.stdout.
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(out.fileno(), 1)
            command("inspect", path, json=True, **options)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return json.loads(out.read().decode("utf-8"))
