//! Allocator settings that keep resident memory inside the plan.
//!
//! glibc's malloc raises its mmap threshold each time a large mmapped block is freed, so after
//! the first expert buffer is released, later multi-megabyte read buffers come from the heap
//! arenas of the threads that read them and freed space stays resident there. Measured on the
//! `bench` synthetic checkpoint at a 2 GB budget: peak RSS 2.025 GB with the dynamic threshold,
//! 1.978 GB (inside the plan) with it pinned. Pinning it at 1 MiB makes every large buffer an
//! mmap that goes back to the system when freed.
#![allow(unsafe_code)]

/// Pin glibc's mmap threshold at 1 MiB (no effect elsewhere). Call once at start-up, before
/// other threads allocate; `MALLOC_MMAP_THRESHOLD_` in the environment takes precedence.
pub fn pin_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
            return;
        }
        extern "C" {
            fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
        }
        /// glibc's `M_MMAP_THRESHOLD`.
        const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
        // SAFETY: mallopt only changes a tunable of the C allocator; it is thread-safe in
        // glibc, takes plain integers, and a refusal (return value 0) leaves malloc as it was.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 1 << 20);
        }
    }
}
