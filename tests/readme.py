"""The shell commands README.md shows, parsed, so that tests run them as written (issue 32).

A command is a line of a ```bash block, or an inline code span that starts, after any
``VAR=value`` settings, with ``python``, ``bash``, ``pip install``, a venv's python or a
``scripts/`` file followed by arguments,
``PY=$(`` or the device tool's ``run(``. Plain ``` blocks are console output, not commands.
``readme_command(prefix)`` gives a test the (env, argv) of one of them, so the string lives
in the README only; tests/test_readme_commands.py checks every command is run by a test or
named as needing hardware or a network CI lacks."""
import importlib
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=[^\s$]\S*\s+)*")
_STARTS = ("python ", "python3 ", "bash ", "pip install ", "run(", "$PY ")
_PATHS = (".venv", "scripts/")      # a command when arguments follow (else a file's name)
# What the caller adds in place of these (its own overrides / flags).
OPTIONAL = ("[hydra overrides]", "<your usual overrides>", "[size flags]")


def _is_command(text: str) -> bool:
    if re.match(r"^[A-Z_]+=\$\(", text):
        return True
    rest = text[_ENV.match(text).end():]
    return rest.startswith(_STARTS) or rest.startswith(_PATHS) and " " in rest or rest == "python"


def commands(text: str = None) -> list[str]:
    """Every command the README shows, in order, each once (whitespace normalised)."""
    text = README.read_text() if text is None else text
    found, prose, fence = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence is None:
            prose.append(line)
        elif fence in ("bash", "sh", "shell"):
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(line)
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        span = " ".join(span.split())
        if _is_command(span):
            found.append(span)
    return list(dict.fromkeys(" ".join(c.split()) for c in found))


def find(prefix: str, cmds=None) -> str:
    """The README command equal to ``prefix``, else the only one that starts with it."""
    cmds = commands() if cmds is None else cmds
    match = [c for c in cmds if c == prefix] or [c for c in cmds if c.startswith(prefix)]
    if len(match) != 1:
        raise LookupError(f"README: {len(match)} commands start with {prefix!r}: {match}")
    return match[0]


def readme_command(prefix: str, python=sys.executable, fill=None):
    """(env, argv) of the README command equal to ``prefix``, else the one command starting
    with it. ``python`` (and a ``.venv*/bin/python`` or ``bash scripts/...`` path) resolves
    to ``python`` / the checkout; ``fill`` maps a placeholder (a word: ``M``, ``DIR``, ``{a,b}``;
    or the ``...`` of ``key=...``) to its value; OPTIONAL placeholders are dropped (the caller adds
    its own overrides)."""
    cmd = find(prefix)
    for placeholder in OPTIONAL:
        cmd = cmd.replace(placeholder, "")
    env_part = _ENV.match(cmd).group(0)
    env = dict(kv.split("=", 1) for kv in env_part.split())
    argv = shlex.split(cmd[len(env_part):])
    for k, v in (fill or {}).items():
        argv = [str(v) if a == k else a.replace(f"={k}", f"={v}") if a.endswith(f"={k}") else a for a in argv]
    left = [a for a in argv if a in ("M", "N", "DIR", "...") or a.endswith("=...") or a.startswith(("<", "[", "{"))]
    if left:
        raise ValueError(f"README command {find(prefix)!r}: placeholder(s) {left} not filled")
    if argv[0] in ("python", "python3"):
        argv[0] = str(python)
    elif argv[0].startswith(".venv"):
        argv[0] = str(ROOT / argv[0])
    elif argv[0] == "bash" and argv[1].startswith("scripts/"):
        argv[1] = str(ROOT / argv[1])
    return env, argv


def benchmark(monkeypatch, name: str):
    """benchmarks/<name>.py (a script the README runs) imported fresh as a module, for unit tests of its parts."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop(name, None)
    return importlib.import_module(name)
