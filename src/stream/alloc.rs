//! Allocator settings that keep resident memory inside the plan.
//!
//! With glibc's defaults every reading thread gets its own malloc arena, and the space a freed
//! multi-megabyte read buffer leaves in one arena is not reused by the others, so resident
//! memory creeps above what is live. Measured on the `bench` synthetic checkpoint with the
//! packed trunk: peak RSS 2.025 GB at a 2 GB budget with the defaults, 1.981 GB with one arena
//! and a fixed 32 MiB mmap threshold (1.00 GB → 0.95 GB at a 1 GB budget), at the same ratio
//! to the I/O floor. Pinning the threshold at 1 MiB instead also kept RSS inside the plan but
//! cost a page fault per 4 KiB of every weight read (about 1.6× slower per token).
#![allow(unsafe_code)]

/// Give the memory the C allocator holds free back to the system (glibc's `malloc_trim`; no
/// effect elsewhere). Freed allocations above the mmap threshold are unmapped at once; smaller
/// ones stay in the heap until trimmed, so after a plan shrinks (expert slots, pinned layers,
/// pooled read buffers dropped) this is what lets resident memory follow the budget down.
pub fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes the allocator's own lock and only releases pages of free
        // chunks (madvise / sbrk); no live allocation is touched, and any thread may call it.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// One malloc arena and a fixed 32 MiB mmap threshold (glibc only; no effect elsewhere).
/// Called once at start-up, before other threads allocate. `MALLOC_ARENA_MAX` or
/// `MALLOC_MMAP_THRESHOLD_` in the environment take precedence.
pub fn keep_rss_inside_the_plan() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            // SAFETY: mallopt only changes a tunable of the C allocator; it is thread-safe in
            // glibc, takes plain integers, and a refusal (return value 0) leaves malloc as it was.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            }
        }
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            // SAFETY: as above.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, 1);
            }
        }
    }
}
