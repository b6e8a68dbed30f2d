"""glibc malloc settings for serving are applied where the C library is glibc."""

import platform

from chatsvc.engine.allocator import keep_freed_memory


def test_malloc_settings_apply_on_glibc_only():
    applied = keep_freed_memory()
    assert applied is (platform.libc_ver()[0] == "glibc")
    assert keep_freed_memory() is applied  # idempotent
