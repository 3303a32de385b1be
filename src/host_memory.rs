//! Large zeroed host buffers, allocated untouched: the allocator maps
//! fresh (zero) pages for large sizes, so no byte is written until the
//! buffer's user writes it, and memory is faulted in as it is touched,
//! not all at once. (Not always: a large `calloc` may reuse heap memory
//! already touched, so [`WeightBytes`] maps its chunks itself.)
//!
//! Weights ask for 2 MiB pages: the dense weight arena
//! ([`zeroed_on_huge_pages`]) and the repacked quantised weights
//! ([`WeightBytes`]). Linux's default transparent-huge-page mode
//! (`madvise`) backs only memory that asks, and only whole, aligned 2 MiB
//! pages of it; on 4 KiB pages decode's weight streams take a TLB miss
//! every 4 KiB. The CPU KV pool does not ([`zeroed`]; `crate::kv` says
//! why). `TANDEM_NO_HUGE_PAGES=1` skips the advice, for A/B measurements.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

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

/// Bytes of a [`WeightBytes`] chunk: room for many projections, so that
/// weights far smaller than a huge page (a 576 × 576 Q4_1 projection is
/// 207 KB) still sit on huge pages, packed one after another.
const CHUNK: usize = 64 << 20;

/// Where a [`WeightBytes`] slot starts inside its chunk.
const SLOT_ALIGN: usize = 64;

/// One zeroed allocation advised for huge pages, shared by the slots
/// carved from it and freed with the last of them.
struct Chunk {
    /// The allocation's first 2 MiB boundary, where the slots start.
    start: NonNull<u8>,
    /// Bytes from `start` on.
    size: usize,
    _mapping: Mapping,
}

// SAFETY: a chunk is a plain allocation; it hands out disjoint slots, and
// only a slot's owner reads or writes the slot's bytes.
unsafe impl Send for Chunk {}
// SAFETY: as for Send: shared references give nothing but the pointer.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// Room for `bytes` from a 2 MiB boundary, zeroed, on huge pages where
    /// Linux grants them; `None` when the allocation fails.
    fn new(bytes: usize) -> Option<Arc<Self>> {
        let size = bytes.next_multiple_of(HUGE_PAGE);
        let (mapping, at) = Mapping::new(size + HUGE_PAGE)?;
        let base = (at as usize).next_multiple_of(HUGE_PAGE) - at as usize;
        advise_huge_pages(at as usize, size + HUGE_PAGE);
        // SAFETY: `base < HUGE_PAGE`, so `size` bytes from it stay inside.
        let start = NonNull::new(unsafe { at.add(base) })?;
        Some(Arc::new(Self {
            start,
            size,
            _mapping: mapping,
        }))
    }
}

/// A fresh anonymous mapping, unmapped on drop. Mapped directly rather
/// than through the allocator: a large `calloc` may be served from memory
/// the heap already touched (SmolLM2's 30 MB unembedding landed there, on
/// 4 KiB pages, once the load's temporary buffers were freed), and pages
/// already touched keep their size.
#[cfg(target_os = "linux")]
struct Mapping {
    at: NonNull<u8>,
    len: usize,
}

#[cfg(target_os = "linux")]
impl Mapping {
    /// `len` zero bytes and where they start.
    fn new(len: usize) -> Option<(Self, *mut u8)> {
        // SAFETY: a fresh private anonymous mapping names no existing
        // memory; its pages read as zero until written.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return None;
        }
        let at = NonNull::new(at.cast::<u8>())?;
        Some((Self { at, len }, at.as_ptr()))
    }
}

#[cfg(target_os = "linux")]
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length, unmapped once, after
        // the chunk's last slot is gone.
        unsafe {
            libc::munmap(self.at.as_ptr().cast(), self.len);
        }
    }
}

/// Elsewhere (no huge-page advice): a zeroed vector, read and written
/// only through the pointer taken at creation.
#[cfg(not(target_os = "linux"))]
struct Mapping(Vec<u8>);

#[cfg(not(target_os = "linux"))]
impl Mapping {
    fn new(len: usize) -> Option<(Self, *mut u8)> {
        let mut v = zeroed::<u8>(len)?;
        let at = v.as_mut_ptr();
        Some((Self(v), at))
    }
}

/// The chunk new slots are carved from, and the offset of its free room.
/// Weak: a chunk lives as long as its slots, not as long as the process.
static CURRENT: Mutex<(Weak<Chunk>, usize)> = Mutex::new((Weak::new(), 0));

/// A zeroed, exclusively owned byte buffer for weights, carved with others
/// from shared 2 MiB-aligned chunks on huge pages (one chunk per 64 MiB of
/// weights, or one of its own for a larger weight), so that a model's
/// repacked projections stream from huge pages whatever their sizes.
/// Slots never overlap; a chunk is freed when its last slot drops.
pub(crate) struct WeightBytes {
    chunk: Arc<Chunk>,
    offset: usize,
    len: usize,
}

impl WeightBytes {
    /// `len` zero bytes, or `None` when no memory could be allocated.
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        let (weak, next) = &mut *current;
        if let Some(chunk) = weak.upgrade() {
            if *next + len <= chunk.size {
                let offset = *next;
                *next = (offset + len).next_multiple_of(SLOT_ALIGN);
                return Some(Self { chunk, offset, len });
            }
        }
        let chunk = Chunk::new(len.max(CHUNK))?;
        *weak = Arc::downgrade(&chunk);
        *next = len.next_multiple_of(SLOT_ALIGN);
        Some(Self {
            chunk,
            offset: 0,
            len,
        })
    }
}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `offset + len` lies inside the chunk, which outlives
        // `self`; the slot's bytes are initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.chunk.start.as_ptr().add(self.offset), self.len) }
    }
}

impl std::ops::DerefMut for WeightBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for Deref; no other slot covers these bytes, and
        // `&mut self` makes this the only reference to them.
        unsafe {
            std::slice::from_raw_parts_mut(self.chunk.start.as_ptr().add(self.offset), self.len)
        }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::{WeightBytes, CHUNK, SLOT_ALIGN};

    #[test]
    fn weight_bytes_are_zeroed_disjoint_aligned_slots() {
        let mut a = WeightBytes::zeroed(1000).unwrap();
        let mut b = WeightBytes::zeroed(3).unwrap();
        assert!(a.iter().chain(b.iter()).all(|&x| x == 0));
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        assert_eq!(b.as_ptr() as usize % SLOT_ALIGN, 0);
        // A weight larger than a chunk gets a chunk of its own.
        let big = WeightBytes::zeroed(CHUNK + 1).unwrap();
        assert_eq!(big.len(), CHUNK + 1);
        assert_eq!(big.as_ptr() as usize % super::HUGE_PAGE, 0);
        drop(a);
        assert!(b.iter().all(|&x| x == 2), "a slot outlives its neighbours");
    }
}
