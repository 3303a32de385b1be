//! Large zeroed host buffers, allocated untouched: the allocator maps
//! fresh (zero) pages for large sizes, so no byte is written until the
//! buffer's user writes it, and memory is faulted in as it is touched,
//! not all at once.
//!
//! The model's weight arena also asks for 2 MiB pages
//! ([`zeroed_on_huge_pages`]): Linux's default transparent-huge-page mode
//! (`madvise`) backs only memory that asks, and only whole, aligned 2 MiB
//! pages of it; on 4 KiB pages decode's weight streams take a TLB miss
//! every 4 KiB. The CPU KV pool does not ([`zeroed`]; `crate::kv` says
//! why). `TANDEM_NO_HUGE_PAGES=1` skips the advice, for A/B measurements.

/// Bytes of a huge page.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// A zeroed vector of `len` elements of `T` whose whole 2 MiB pages are
/// advised for huge pages, padded so that `len` elements fit from the
/// first 2 MiB boundary inside it; returns it and the index of that
/// boundary. `T` must be a type whose all-zero bytes are a valid value
/// (the float and integer types it is used with). `None` when the
/// allocation fails.
pub(crate) fn zeroed_on_huge_pages<T: candle_core::WithDType>(
    len: usize,
) -> Option<(Vec<T>, usize)> {
    let size = std::mem::size_of::<T>();
    let cap = len + 2 * HUGE_PAGE / size;
    let v = zeroed::<T>(cap)?;
    advise_huge_pages(v.as_ptr() as usize, cap * size);
    let base = ((v.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - v.as_ptr() as usize) / size;
    Some((v, base))
}

/// A vector of `len` zeroed elements of `T` whose pages are left
/// untouched (fresh pages are zero), or `None` when the allocation fails:
/// memory is faulted in as it is first written, not all at once. `T`: as
/// for [`zeroed_on_huge_pages`].
pub(crate) fn zeroed<T: candle_core::WithDType>(len: usize) -> Option<Vec<T>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    // SAFETY: the layout is non-zero-sized; the pointer is checked below.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return None;
    }
    // SAFETY: allocated by the global allocator for exactly `len` elements
    // of T's alignment; every byte is zero, a valid value of T.
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Asks Linux to back the whole 2 MiB pages of `[addr, addr + bytes)` with
/// huge pages, unless `TANDEM_NO_HUGE_PAGES` is set.
fn advise_huge_pages(addr: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        let (first, end) = (
            addr.next_multiple_of(HUGE_PAGE),
            (addr + bytes) / HUGE_PAGE * HUGE_PAGE,
        );
        if end > first && std::env::var_os("TANDEM_NO_HUGE_PAGES").is_none() {
            // SAFETY: the range lies inside an allocation nobody has touched
            // yet; madvise only changes how the kernel backs it.
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, bytes);
}
