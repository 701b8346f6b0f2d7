//! Opening a checkpoint directory (single file, or shards through
//! `model.safetensors.index.json`) and reading tensors with positioned reads.

use super::arena::Arena;
use super::bytes::{as_uninit, Bytes, Filling, U16s};
use super::index::{IndexError, TensorIndex, TensorInfo};
use super::mapped::MappedFile;
use super::safetensors::{header_len, parse_header, Dtype};
use super::weight_map::{self, Tensors, WeightMap};
use super::StreamError;
use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Largest single positioned read (Linux caps a read at 0x7ffff000 bytes; macOS refuses 2 GiB).
const MAX_READ: usize = 1 << 30;

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("tensors", &self.index.len())
            .finish()
    }
}

/// An open, fully validated checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<File>,
    paths: Vec<PathBuf>,
    index: TensorIndex,
    bytes_read: AtomicU64,
    progress: Option<Progress>,
    /// Drop the page cache behind every read (streaming), so resident memory and disk
    /// figures are honest.
    drop_behind: std::sync::atomic::AtomicBool,
    /// Set when what is being read is no longer wanted (see [`Checkpoint::stop_loading`]).
    stopped: std::sync::atomic::AtomicBool,
    /// Positioned reads issued so far, and an injected fault (tests).
    reads: AtomicU64,
    fault: FaultSlot,
    /// Per shard, a second descriptor opened with `O_DIRECT` (None where the filesystem
    /// refuses it), and whether direct reads on it have been given up.
    direct: Vec<Option<File>>,
    direct_off: Vec<std::sync::atomic::AtomicBool>,
    /// The slots group reads (routed experts) land in, given back once an expert is dropped.
    group_arena: std::sync::OnceLock<std::sync::Arc<Arena>>,
    /// Per shard: its length when opened, and its mapping once made (None: not mappable).
    lens: Vec<u64>,
    maps: Vec<std::sync::OnceLock<Option<std::sync::Arc<MappedFile>>>>,
}

thread_local! {
    /// This thread's aligned window for direct reads, kept between reads.
    static SCRATCH: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::default());
}

/// Largest per-thread read buffer kept for reuse; larger ones are freed after their read.
const KEEP_BYTES: usize = 64 << 20;

/// Largest piece of a direct read into a caller's buffer: each piece goes through this
/// thread's aligned window, so the window never grows past this (plus its alignment) whatever
/// the read's length (a streamed output head's chunk is 64 MiB; one window of that size,
/// allocated and freed each time, was memory the plan did not count).
const DIRECT_PIECE: usize = 8 << 20;

/// What identifies a shard's bytes without reading them: its size and modification time, and
/// its inode and change time, which every write changes (restoring the modification time, as
/// `cp -p` or `rsync -a` do, changes the change time too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardStat {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, whole seconds since the Unix epoch.
    pub mtime_sec: i64,
    /// Modification time, nanoseconds within the second.
    pub mtime_nsec: i64,
    /// Inode number.
    pub ino: u64,
    /// Status change time, whole seconds since the Unix epoch.
    pub ctime_sec: i64,
    /// Status change time, nanoseconds within the second.
    pub ctime_nsec: i64,
}

/// A tensor's name, dtype and raw bytes (a range of the allocation its read filled).
pub type RawTensor = (String, Dtype, Bytes);

/// Alignment of file offsets, lengths and buffer addresses for `O_DIRECT` (4Kn devices).
pub const DIRECT_ALIGN: usize = 4096;

/// Reads shorter than this stay buffered (with the cache dropped behind them): a direct read
/// is a device round trip, which costs more than it saves on a small tensor.
pub const DIRECT_MIN: u64 = 256 << 10;

/// A byte buffer whose usable part starts at a `DIRECT_ALIGN`-aligned address.
#[derive(Debug, Default)]
pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes starting at an aligned address.
    #[must_use]
    pub fn new(len: usize) -> Self {
        let mut b = AlignedBuf::default();
        b.resize(len);
        b
    }

    /// Make the usable part `len` bytes long (contents unspecified), reusing the allocation.
    pub fn resize(&mut self, len: usize) {
        if self.raw.len() < len + DIRECT_ALIGN
            || self.raw.as_ptr().align_offset(DIRECT_ALIGN) + len > self.raw.len()
        {
            self.raw = vec![0u8; len + DIRECT_ALIGN];
        }
        self.start = self.raw.as_ptr().align_offset(DIRECT_ALIGN);
        self.len = len;
    }

    /// Bytes allocated.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.raw.len()
    }

    /// The usable bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    /// The usable bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// Threads that read weights: reads block in the kernel, so more of them than cores keeps
/// the device's queue full (`K3_IO_THREADS`, default 8). Results do not depend on it; None
/// when the threads cannot be started (the caller's threads read then).
pub fn io_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = crate::tuning::Tuning::get().io_threads;
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("k3-io-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Open `path` for reading with `O_DIRECT`, or None where that is refused.
pub(crate) fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::DIRECT.bits() as i32;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .ok()
}

/// A fault to inject into the n-th positioned read (counting from 0), for tests of the
/// retry and failure paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read is interrupted (EINTR) once: retried.
    Interrupted,
    /// The read returns only part of what was asked: the rest is read by a second call.
    Short,
    /// The read fails with EIO, and so does its one retry: the step fails with an error
    /// naming the shard and offset.
    Io,
    /// The read fails with EIO once: the one bounded retry succeeds.
    TransientIo,
}

/// Environment variable that arms one read fault in `k3 chat`, for tests of the failure
/// paths through the real binary: `KIND@N` with KIND one of `eintr`, `short`, `eio` (fails, and
/// so does its retry) or `eio-once`, and N the positioned read it hits, counted from the moment
/// the model is open (so `eio@0` fails the first weight read of the first turn when the model
/// is streamed). Read only by builds with the `fault-injection` feature (the tests'); a
/// release build ignores it.
#[cfg(feature = "fault-injection")]
pub const FAULT_ENV: &str = "K3_FAULT";

#[cfg(feature = "fault-injection")]
impl Fault {
    /// Parse a [`FAULT_ENV`] value: the fault and the read it hits.
    #[must_use]
    pub fn parse_spec(spec: &str) -> Option<(Fault, u64)> {
        let (kind, n) = spec.split_once('@')?;
        let fault = match kind {
            "eintr" => Fault::Interrupted,
            "short" => Fault::Short,
            "eio" => Fault::Io,
            "eio-once" => Fault::TransientIo,
            _ => return None,
        };
        Some((fault, n.parse().ok()?))
    }
}

/// A fault armed for the n-th positioned read: two atomics, so the read path takes no lock.
/// Without the `fault-injection` feature it is empty and never fires.
#[cfg(feature = "fault-injection")]
#[derive(Debug)]
pub(crate) struct FaultSlot {
    /// The read it applies to (`u64::MAX`: none).
    at: AtomicU64,
    kind: std::sync::atomic::AtomicU8,
}

/// Without the `fault-injection` feature (release builds) no read can be made to fail.
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, Default)]
pub(crate) struct FaultSlot;

#[cfg(not(feature = "fault-injection"))]
impl FaultSlot {
    /// No fault is ever armed.
    #[inline(always)]
    fn get(&self, _n: u64) -> Option<Fault> {
        None
    }
}

#[cfg(feature = "fault-injection")]
impl Default for FaultSlot {
    fn default() -> Self {
        FaultSlot {
            at: AtomicU64::new(u64::MAX),
            kind: std::sync::atomic::AtomicU8::new(0),
        }
    }
}

#[cfg(feature = "fault-injection")]
impl FaultSlot {
    const KINDS: [Fault; 4] = [
        Fault::Interrupted,
        Fault::Short,
        Fault::Io,
        Fault::TransientIo,
    ];

    /// Arm `fault` for read number `n`.
    pub(crate) fn arm(&self, n: u64, fault: Fault) {
        let k = Self::KINDS.iter().position(|&f| f == fault).unwrap_or(0);
        self.kind.store(k as u8, Ordering::Relaxed);
        self.at.store(n, Ordering::Release);
    }

    /// The fault armed for read number `n`, if any.
    fn get(&self, n: u64) -> Option<Fault> {
        (self.at.load(Ordering::Acquire) == n)
            .then(|| Self::KINDS[usize::from(self.kind.load(Ordering::Relaxed)) % 4])
    }
}

/// Called with the total bytes read so far after every read.
pub type Progress = Box<dyn Fn(u64) + Send + Sync>;

/// Tensor contents widened or copied into an owned buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// float32 values (F32, or F16 widened exactly).
    F32(Vec<f32>),
    /// bfloat16 raw bits, in place in the buffer they were read into.
    Bf16(U16s),
    /// Bytes, in place in the buffer they were read into.
    U8(Bytes),
}

fn index_err(path: &Path, name: &str, e: IndexError) -> StreamError {
    match e {
        IndexError::Duplicate {
            name,
            first,
            second,
        } => StreamError::DuplicateTensor {
            name,
            first,
            second,
        },
        IndexError::Unrepresentable(reason) => StreamError::Unrepresentable {
            path: path.to_path_buf(),
            name: name.to_string(),
            reason,
        },
    }
}

/// The bytes of `model.safetensors.index.json`, refused above [`weight_map::MAX_INDEX_LEN`]
/// before they are read (and if the file grows while it is read).
fn read_index_bytes(path: &Path) -> Result<Vec<u8>, StreamError> {
    use std::io::Read;
    let open_err = |e| StreamError::Open {
        path: path.to_path_buf(),
        source: e,
    };
    let too_big = |len: u64| StreamError::Index {
        path: path.to_path_buf(),
        reason: format!(
            "{len} bytes, above the maximum of {} bytes for an index",
            weight_map::MAX_INDEX_LEN
        ),
    };
    let (file, len) = crate::stream::open_regular(path).map_err(open_err)?;
    if len > weight_map::MAX_INDEX_LEN {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(weight_map::MAX_INDEX_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(open_err)?;
    if bytes.len() as u64 > weight_map::MAX_INDEX_LEN {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Parse the bytes of a `model.safetensors.index.json`: the shard files its `weight_map`
/// names, each with the tensors it should hold; the reason when it is refused.
pub fn parse_weight_map(bytes: &[u8]) -> Result<WeightMap<'_>, String> {
    weight_map::parse(bytes)
}

impl Checkpoint {
    /// Open `dir`, validate every shard header, and build the index.
    pub fn open(dir: &Path) -> Result<Self, StreamError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let index_bytes;
        // Anything at the index's path is read (and refused by name when it is not a regular
        // file); only its absence means "list the directory".
        let (shards, expected) = if index_path.exists() {
            index_bytes = read_index_bytes(&index_path)?;
            let map = parse_weight_map(&index_bytes).map_err(|reason| StreamError::Index {
                path: index_path.clone(),
                reason,
            })?;
            let missing: Vec<String> = map
                .files()
                .filter(|(f, _)| !dir.join(f).exists())
                .map(|(f, t)| {
                    format!(
                        "{f:?} (needed by {} tensors, e.g. {:?})",
                        t.len(),
                        t.first().unwrap_or_default()
                    )
                })
                .collect();
            if !missing.is_empty() {
                return Err(StreamError::MissingShards {
                    dir: dir.to_path_buf(),
                    files: missing,
                });
            }
            let shards: Vec<String> = map.files().map(|(f, _)| f.to_string()).collect();
            (shards, Some(map))
        } else if single.exists() {
            (vec!["model.safetensors".to_string()], None)
        } else {
            let mut v: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| StreamError::Open {
                    path: dir.to_path_buf(),
                    source: e,
                })?
                .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            v.sort();
            (v, None)
        };
        if shards.is_empty() {
            return Err(StreamError::NoShards {
                dir: dir.to_path_buf(),
            });
        }
        let mut ck = Checkpoint {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            paths: Vec::new(),
            index: TensorIndex::default(),
            bytes_read: AtomicU64::new(0),
            progress: None,
            drop_behind: std::sync::atomic::AtomicBool::new(false),
            stopped: std::sync::atomic::AtomicBool::new(false),
            reads: AtomicU64::new(0),
            fault: FaultSlot::default(),
            direct: Vec::new(),
            direct_off: Vec::new(),
            group_arena: std::sync::OnceLock::new(),
            lens: Vec::new(),
            maps: Vec::new(),
        };
        for name in &shards {
            ck.add_shard(
                name,
                expected.as_ref().and_then(|m| m.tensors(name)),
                &index_path,
            )?;
        }
        if let Some(map) = &expected {
            ck.check_strays(map, &index_path)?;
        }
        drop(expected);
        let first = ck.paths.first().cloned().unwrap_or_default();
        ck.index.finish().map_err(|e| index_err(&first, "", e))?;
        Ok(ck)
    }

    fn add_shard(
        &mut self,
        name: &str,
        expected: Option<Tensors<'_, '_>>,
        index_path: &Path,
    ) -> Result<(), StreamError> {
        let path = self.dir.join(name);
        let open_err = |e| StreamError::Open {
            path: path.clone(),
            source: e,
        };
        // Opening a FIFO would block until a writer comes: look before opening.
        let kind = std::fs::metadata(&path).map_err(open_err)?.file_type();
        if !kind.is_file() {
            return Err(StreamError::NotRegular {
                path: path.clone(),
                kind: crate::stream::file_kind(kind),
            });
        }
        let file = File::open(&path).map_err(open_err)?;
        let file_len = file.metadata().map_err(open_err)?.len();
        let header_err = |e| StreamError::Header {
            path: path.clone(),
            source: e,
        };
        let mut prefix = [0u8; 16];
        let got = read_prefix(&file, &mut prefix).map_err(open_err)?;
        let n = header_len(&prefix[..got], file_len).map_err(header_err)?;
        let mut json = vec![0u8; n as usize];
        file.read_exact_at(&mut json, 8).map_err(open_err)?;
        let data_start = 8 + n;
        let entries = parse_header(&json, file_len - data_start).map_err(header_err)?;
        if let Some(want) = expected {
            let mut have: Vec<&str> = entries.iter().map(|e| e.name.as_ref()).collect();
            have.sort_unstable();
            // Both sorted (and each without repeats): one walk finds what is in one only.
            let (mut absent, mut first_absent, mut extra) = (0usize, None, None);
            let mut have_it = have.iter().copied().peekable();
            for t in want.names() {
                while let Some(h) = have_it.next_if(|&h| h < t) {
                    extra = extra.or(Some(h));
                }
                if have_it.next_if_eq(&t).is_none() {
                    absent += 1;
                    first_absent = first_absent.or(Some(t));
                }
            }
            let extra = extra.or_else(|| have_it.next());
            if let Some(first) = first_absent {
                return Err(StreamError::Index {
                    path: index_path.to_path_buf(),
                    reason: format!(
                        "{absent} tensor(s) mapped to {name} are not in it, e.g. {first:?}"
                    ),
                });
            }
            if let Some(extra) = extra {
                return Err(StreamError::Index {
                    path: index_path.to_path_buf(),
                    reason: format!("tensor {extra:?} in {name} is not in the weight_map"),
                });
            }
        }
        let shard = self
            .index
            .add_shard(name)
            .map_err(|e| index_err(&path, "", e))?;
        for e in &entries {
            self.index
                .push(shard, &e.name, e.dtype, e.shape(), data_start + e.begin)
                .map_err(|err| index_err(&path, &e.name, err))?;
        }
        self.files.push(file);
        self.paths.push(path);
        self.lens.push(file_len);
        self.maps.push(std::sync::OnceLock::new());
        Ok(())
    }

    /// With an index file, a `.safetensors` file it does not name is refused.
    fn check_strays(&self, map: &WeightMap<'_>, index_path: &Path) -> Result<(), StreamError> {
        let strays: Vec<String> = std::fs::read_dir(&self.dir)
            .map_err(|e| StreamError::Open {
                path: self.dir.clone(),
                source: e,
            })?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.ends_with(".safetensors") && !map.contains_file(n))
            .map(|n| format!("{n:?}"))
            .collect();
        if strays.is_empty() {
            Ok(())
        } else {
            Err(StreamError::Index {
                path: index_path.to_path_buf(),
                reason: format!(
                    "{} shard file(s) not named by the index: {}",
                    strays.len(),
                    crate::stream::join_listed(&strays)
                ),
            })
        }
    }

    /// The model directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of shard number `shard`.
    #[must_use]
    pub fn shard_path(&self, shard: usize) -> Option<&Path> {
        self.paths.get(shard).map(PathBuf::as_path)
    }

    /// Read `buf.len()` bytes at absolute offset `at` of shard `shard` through its buffered
    /// descriptor, outside the read counters and fault injection (a packed trunk's check of
    /// its source at open, docs/runtime.md#packed-trunk).
    pub fn pread_plain(&self, shard: usize, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let file = self.files.get(shard).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such shard number")
        })?;
        file.read_exact_at(buf, at)
    }

    /// Size and modification time of shard number `shard`, from the descriptor it is read
    /// through (so a file replaced by rename after open is seen as the one being read).
    pub fn shard_stat(&self, shard: usize) -> std::io::Result<ShardStat> {
        use std::os::unix::fs::MetadataExt;
        let file = self.files.get(shard).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such shard number")
        })?;
        let m = file.metadata()?;
        Ok(ShardStat {
            size: m.len(),
            mtime_sec: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
            ino: m.ino(),
            ctime_sec: m.ctime(),
            ctime_nsec: m.ctime_nsec(),
        })
    }

    /// Drop the page cache behind each read from now on (`posix_fadvise(DONTNEED)`; a hint,
    /// ignored where unsupported).
    pub fn set_drop_behind(&self, on: bool) {
        self.drop_behind.store(on, Ordering::Relaxed);
    }

    /// Read with `O_DIRECT` (bypassing the page cache) on every shard whose filesystem
    /// allows it; returns how many shards will. Reads are widened to 4096-byte windows.
    pub fn set_direct(&mut self, on: bool) -> usize {
        self.direct = if on {
            self.paths.iter().map(|p| open_direct(p)).collect()
        } else {
            Vec::new()
        };
        self.direct_off = self
            .direct
            .iter()
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect();
        self.direct.iter().filter(|f| f.is_some()).count()
    }

    /// Whether reads of `shard` currently go around the page cache.
    #[must_use]
    pub fn is_direct(&self, shard: usize) -> bool {
        self.direct.get(shard).is_some_and(Option::is_some)
            && !self.direct_off[shard].load(Ordering::Relaxed)
    }

    /// Whether a read of `len` bytes from `shard` goes around the page cache.
    fn reads_direct(&self, shard: usize, len: u64) -> bool {
        len >= DIRECT_MIN && self.is_direct(shard)
    }

    fn after_read(&self, shard: usize, offset: u64, len: u64) {
        let total = self.bytes_read.fetch_add(len, Ordering::Relaxed) + len;
        if let Some(p) = &self.progress {
            p(total);
        }
        if self.drop_behind.load(Ordering::Relaxed) && !self.reads_direct(shard, len) {
            if let Some(n) = std::num::NonZeroU64::new(len) {
                let _ = rustix::fs::fadvise(
                    &self.files[shard],
                    offset,
                    Some(n),
                    rustix::fs::Advice::DontNeed,
                );
            }
        }
    }

    /// Inject `fault` into the `n`-th positioned read from now on (counting reads since open).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self, n: u64, fault: Fault) {
        self.fault.arm(n, fault);
    }

    /// Tell a load in progress that its weights are no longer wanted (the checkpoint was
    /// refused while they were read): loaders check [`Checkpoint::loading_stopped`] between
    /// weights and give up. Reads already issued finish.
    pub fn stop_loading(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }

    /// Whether [`Checkpoint::stop_loading`] was called.
    #[must_use]
    pub fn loading_stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    /// Positioned reads issued so far.
    #[must_use]
    pub fn reads_issued(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// One positioned read of exactly `buf.len()` bytes at `at`: retried on EINTR and on a
    /// short count, failing on any other error or on end of file.
    fn pread_exact(&self, shard: usize, buf: &mut [u8], at: u64) -> std::io::Result<()> {
        let need = buf.len();
        pread_counted(
            &self.reads,
            &self.fault,
            &self.files[shard],
            as_uninit(buf),
            at,
            need,
        )
        .map(|_| ())
    }

    /// Read `buf.len()` bytes at `at` from `shard` through its `O_DIRECT` descriptor: the
    /// read is widened to an aligned window in an aligned scratch buffer, then the payload is
    /// copied out. Falls back to buffered reads for good if the filesystem refuses.
    fn pread_direct(
        &self,
        shard: usize,
        buf: &mut [u8],
        at: u64,
        scratch: &mut AlignedBuf,
    ) -> std::io::Result<()> {
        let Some(file) = self.direct.get(shard).and_then(Option::as_ref) else {
            return self.pread_exact(shard, buf, at);
        };
        let a = DIRECT_ALIGN as u64;
        let start = at / a * a;
        let end = (at + buf.len() as u64).div_ceil(a) * a;
        let lead = (at - start) as usize;
        scratch.resize((end - start) as usize);
        // The window may run past the end of the shard: enough once the payload is covered.
        match pread_counted(
            &self.reads,
            &self.fault,
            file,
            as_uninit(scratch.as_mut_slice()),
            start,
            lead + buf.len(),
        ) {
            Ok(_) => {
                buf.copy_from_slice(&scratch.as_slice()[lead..lead + buf.len()]);
                Ok(())
            }
            Err(e) if rustix::io::Errno::from_io_error(&e) == Some(rustix::io::Errno::INVAL) => {
                // EINVAL: this filesystem or device does not take these direct reads.
                self.direct_off[shard].store(true, Ordering::Relaxed);
                self.pread_exact(shard, buf, at)
            }
            Err(e) => Err(e),
        }
    }

    /// Report the running total of bytes read to `f` after every read.
    pub fn set_progress(&mut self, f: Progress) {
        self.progress = Some(f);
    }

    /// Tensor bytes read so far (headers excluded).
    #[must_use]
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// SHA-256 over every tensor's shard name, name, dtype, shape and offset, in name order:
    /// it changes whenever the checkpoint's layout does.
    #[must_use]
    pub fn index_digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for name in self.index.names() {
            if let Some(i) = self.index.get(&name) {
                h.update((name.len() as u64).to_le_bytes());
                h.update(name.as_bytes());
                let shard = &self.index.shard_names()[i.shard];
                h.update((shard.len() as u64).to_le_bytes());
                h.update(shard.as_bytes());
                h.update(i.dtype.name().as_bytes());
                h.update((i.shape.len() as u64).to_le_bytes());
                for d in &i.shape {
                    h.update((*d as u64).to_le_bytes());
                }
                h.update(i.offset.to_le_bytes());
            }
        }
        h.finalize().into()
    }

    /// The tensor index.
    #[must_use]
    pub fn index(&self) -> &TensorIndex {
        &self.index
    }

    /// Header information for a tensor.
    #[must_use]
    pub fn info(&self, name: &str) -> Option<TensorInfo> {
        self.index.get(name)
    }

    /// Read a tensor's raw bytes into `buf` (resized to fit).
    pub fn read_raw(&self, name: &str, buf: &mut Vec<u8>) -> Result<TensorInfo, StreamError> {
        let info = self
            .info(name)
            .ok_or_else(|| StreamError::NoSuchTensor(name.to_string()))?;
        self.read_span(name, 0, info.n_bytes(), buf)
    }

    /// Read tensors `names` in one read when they sit gap-free, back to back, in one shard
    /// (the six tensors of a routed expert in the release), returning each one's dtype and
    /// bytes; None when they do not (the caller reads them one by one).
    pub fn read_group(&self, names: &[String]) -> Result<Option<Vec<RawTensor>>, StreamError> {
        let mut infos = Vec::with_capacity(names.len());
        for n in names {
            let Some(i) = self.info(n) else {
                return Ok(None);
            };
            infos.push((n, i));
        }
        infos.sort_by_key(|(_, i)| (i.shard, i.offset));
        let Some((first, start)) = infos.first().map(|(n, i)| (*n, i.clone())) else {
            return Ok(None);
        };
        let mut end = start.offset;
        for (_, i) in &infos {
            if i.shard != start.shard || i.offset != end {
                return Ok(None);
            }
            end += i.n_bytes();
        }
        let all = self.read_shared_in(
            start.shard,
            start.offset,
            end - start.offset,
            first,
            self.group_arena.get(),
        )?;
        let mut parts = Vec::with_capacity(infos.len());
        for (n, i) in infos {
            let at = (i.offset - start.offset) as usize;
            let b = all.slice(at, i.n_bytes() as usize).ok_or_else(|| {
                StreamError::NoSuchTensor(format!("{n} (outside its group read)"))
            })?;
            parts.push((n.clone(), i.dtype, b));
        }
        Ok(Some(parts))
    }

    /// Read `len` bytes at absolute offset `at` of `shard` (a group of tensors whose places
    /// were found once, e.g. a routed expert) into one shared allocation, a slot of the group
    /// arena when one is set; `name` labels errors.
    pub fn read_range_shared(
        &self,
        shard: usize,
        at: u64,
        len: u64,
        name: &str,
    ) -> Result<Bytes, StreamError> {
        self.read_shared_in(shard, at, len, name, self.group_arena.get())
    }

    /// Read `len` bytes at absolute offset `at` of `shard` into `area` (an arena slot read
    /// again in place), as [`Checkpoint::read_range_shared`] reads them into a fresh one:
    /// direct where the shard allows, in its aligned window. Returns where in `area` the
    /// bytes start.
    pub fn read_range_into(
        &self,
        shard: usize,
        at: u64,
        len: u64,
        name: &str,
        area: &mut [MaybeUninit<u8>],
    ) -> Result<usize, StreamError> {
        let err = |offset: u64, source: std::io::Error| StreamError::Read {
            path: self.paths[shard].clone(),
            offset,
            len,
            name: name.to_string(),
            source,
        };
        let too_small = || {
            err(
                at,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "larger than its slot"),
            )
        };
        let ulen = usize::try_from(len).map_err(|_| too_small())?;
        let buffered = |area: &mut [MaybeUninit<u8>]| -> Result<usize, StreamError> {
            let to = area.get_mut(..ulen).ok_or_else(too_small)?;
            let got = read_pieces(&self.reads, &self.fault, &self.files[shard], to, at, ulen)
                .map_err(|e| err(at, e))?;
            if got < ulen {
                return Err(err(at, std::io::ErrorKind::UnexpectedEof.into()));
            }
            Ok(0)
        };
        let direct = self.direct.get(shard).and_then(Option::as_ref);
        let lead = match direct.filter(|_| self.reads_direct(shard, len)) {
            Some(file) => {
                let a = DIRECT_ALIGN as u64;
                let start = at / a * a;
                let end = (at + len).div_ceil(a) * a;
                let lead = (at - start) as usize;
                let window = area
                    .get_mut(..(end - start) as usize)
                    .ok_or_else(too_small)?;
                match read_pieces(&self.reads, &self.fault, file, window, start, lead + ulen) {
                    Ok(got) if got >= lead + ulen => lead,
                    Ok(_) => return Err(err(at, std::io::ErrorKind::UnexpectedEof.into())),
                    Err(e)
                        if rustix::io::Errno::from_io_error(&e)
                            == Some(rustix::io::Errno::INVAL) =>
                    {
                        self.direct_off[shard].store(true, Ordering::Relaxed);
                        buffered(area)?
                    }
                    Err(e) => return Err(err(at, e)),
                }
            }
            None => buffered(area)?,
        };
        self.after_read(shard, at, len);
        Ok(lead)
    }

    /// Read `len` bytes of the shard holding `name`, starting at its first byte and possibly
    /// running past it into the tensors that follow (a layer's contiguous run).
    pub fn read_run(&self, name: &str, len: u64, buf: &mut Vec<u8>) -> Result<(), StreamError> {
        let info = self
            .info(name)
            .ok_or_else(|| StreamError::NoSuchTensor(name.to_string()))?;
        self.read_bytes(info.shard, info.offset, len, name, buf)
    }

    /// Read `len` bytes at absolute offset `at` of `shard` into `buf` (resized to fit);
    /// `name` labels errors.
    fn read_bytes(
        &self,
        shard: usize,
        at0: u64,
        len: u64,
        name: &str,
        buf: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        buf.clear();
        buf.resize(len as usize, 0);
        self.read_bytes_into(shard, at0, name, buf)
    }

    /// Read `buf.len()` bytes at `at0` of shard `shard` into `buf`.
    fn read_bytes_into(
        &self,
        shard: usize,
        at0: u64,
        name: &str,
        buf: &mut [u8],
    ) -> Result<(), StreamError> {
        let len = buf.len() as u64;
        let direct = self.reads_direct(shard, len);
        // Each thread keeps its aligned window between reads (fresh pages cost a fault and a
        // zeroing per 4 KiB); windows above KEEP_BYTES are allocated for the one read.
        let mut scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
        let mut done = 0usize;
        let most = if direct { DIRECT_PIECE } else { MAX_READ };
        while done < buf.len() {
            let take = (buf.len() - done).min(most);
            let at = at0 + done as u64;
            let piece = &mut buf[done..done + take];
            if direct {
                self.pread_direct(shard, piece, at, &mut scratch)
            } else {
                self.pread_exact(shard, piece, at)
            }
            .map_err(|e| StreamError::Read {
                path: self.paths[shard].clone(),
                offset: at,
                len,
                name: name.to_string(),
                source: e,
            })?;
            done += take;
        }
        if scratch.capacity() <= KEEP_BYTES {
            SCRATCH.with(|s| *s.borrow_mut() = scratch);
        }
        self.after_read(shard, at0, len);
        Ok(())
    }

    /// Read `len` bytes starting `offset` bytes into tensor `name` (e.g. a few rows).
    pub fn read_span(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        buf: &mut Vec<u8>,
    ) -> Result<TensorInfo, StreamError> {
        let info = self
            .info(name)
            .ok_or_else(|| StreamError::NoSuchTensor(name.to_string()))?;
        let end = offset.checked_add(len).filter(|&e| e <= info.n_bytes());
        let Some(_) = end else {
            return Err(StreamError::Read {
                path: self.paths[info.shard].clone(),
                offset: info.offset + offset,
                len,
                name: name.to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "span outside the tensor",
                ),
            });
        };
        self.read_bytes(info.shard, info.offset + offset, len, name, buf)?;
        Ok(info)
    }

    /// Read `out.len()` bytes starting `offset` bytes into the tensor `info` describes (found
    /// once with [`Checkpoint::info`]) straight into `out`: no lookup by name, no allocation.
    pub fn read_span_into(
        &self,
        info: &TensorInfo,
        name: &str,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), StreamError> {
        let len = out.len() as u64;
        if offset.checked_add(len).is_none_or(|e| e > info.n_bytes()) {
            return Err(StreamError::Read {
                path: self.paths[info.shard].clone(),
                offset: info.offset + offset,
                len,
                name: name.to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "span outside the tensor",
                ),
            });
        }
        self.read_bytes_into(info.shard, info.offset + offset, name, out)
    }

    /// Read a tensor into a typed owned buffer (F16 is widened to f32).
    pub fn read(&self, name: &str) -> Result<(TensorInfo, TensorData), StreamError> {
        let info = self
            .info(name)
            .ok_or_else(|| StreamError::NoSuchTensor(name.to_string()))?;
        let raw = self.read_shared(info.shard, info.offset, info.n_bytes(), name)?;
        Ok((info.clone(), TensorData::from_bytes(info.dtype, raw)))
    }

    /// [`Checkpoint::read`], or with `mapped` the tensor's bytes as a range of its shard's
    /// read-only mapping, faulted in now and used in place (no copy; the page cache is shared
    /// with other processes). A shard that cannot be mapped is read as without `mapped`.
    pub fn read_maybe_mapped(
        &self,
        name: &str,
        mapped: bool,
    ) -> Result<(TensorInfo, TensorData), StreamError> {
        if mapped {
            if let Some(info) = self.info(name) {
                if let Some(raw) = self.read_mapped(info.shard, info.offset, info.n_bytes()) {
                    return Ok((info.clone(), TensorData::from_bytes(info.dtype, raw)));
                }
            }
        }
        self.read(name)
    }

    /// `len` bytes at `at` of `shard` as a range of its mapping (made on first use), counted
    /// as read; None when the shard does not map.
    fn read_mapped(&self, shard: usize, at: u64, len: u64) -> Option<Bytes> {
        let map = self.maps.get(shard)?.get_or_init(|| {
            MappedFile::map(&self.files[shard], self.lens[shard]).map(std::sync::Arc::new)
        });
        let map = map.as_ref()?;
        let (off, n) = (usize::try_from(at).ok()?, usize::try_from(len).ok()?);
        let bytes = Bytes::mapped(map, off, n)?;
        map.populate(off, n);
        let total = self.bytes_read.fetch_add(len, Ordering::Relaxed) + len;
        if let Some(p) = &self.progress {
            p(total);
        }
        Some(bytes)
    }

    /// Read `len` bytes at absolute offset `at` of `shard` into a new aligned allocation,
    /// straight from the device where direct reads are allowed (the aligned window around the
    /// span is read and the span is a range of it: nothing is copied or zero-filled first).
    pub(crate) fn read_shared(
        &self,
        shard: usize,
        at: u64,
        len: u64,
        name: &str,
    ) -> Result<Bytes, StreamError> {
        self.read_shared_in(shard, at, len, name, None)
    }

    /// Read group reads (experts) into slots of `arena`, so a streamed expert lands in memory
    /// that was faulted in when the plan was made. Set once; later calls do nothing.
    pub fn read_groups_into(&self, arena: std::sync::Arc<Arena>) {
        let _ = self.group_arena.set(arena);
    }

    /// Read tensor `info`'s bytes into `area` (its length), through the page cache, counted as
    /// read: a streamed layer's tensor read into its place in a ring slot.
    pub fn read_tensor_into(
        &self,
        name: &str,
        info: &TensorInfo,
        area: &mut [MaybeUninit<u8>],
    ) -> Result<(), StreamError> {
        let (shard, at, len) = (info.shard, info.offset, info.n_bytes());
        let err = |source: std::io::Error| StreamError::Read {
            path: self.paths[shard].clone(),
            offset: at,
            len,
            name: name.to_string(),
            source,
        };
        if area.len() as u64 != len {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the area does not fit the tensor",
            )));
        }
        let got = read_pieces(
            &self.reads,
            &self.fault,
            &self.files[shard],
            area,
            at,
            len as usize,
        )
        .map_err(err)?;
        if (got as u64) < len {
            return Err(err(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.after_read(shard, at, len);
        Ok(())
    }

    /// [`Checkpoint::read_shared`] into a slot of `arena` where one is free: a new area of
    /// the size [`Checkpoint::read_range_into`] needs (the aligned window of a direct read),
    /// read by it.
    fn read_shared_in(
        &self,
        shard: usize,
        at: u64,
        len: u64,
        name: &str,
        arena: Option<&std::sync::Arc<Arena>>,
    ) -> Result<Bytes, StreamError> {
        let ulen = usize::try_from(len).map_err(|_| StreamError::Read {
            path: self.paths[shard].clone(),
            offset: at,
            len,
            name: name.to_string(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "span too large"),
        })?;
        let direct =
            self.direct.get(shard).is_some_and(Option::is_some) && self.reads_direct(shard, len);
        let n = if direct {
            let a = DIRECT_ALIGN as u64;
            ((at + len).div_ceil(a) * a - at / a * a) as usize
        } else {
            ulen
        };
        let mut fill = match arena {
            Some(a) => Filling::new_in_arena(n, a),
            None => Filling::new(n),
        };
        let lead = self.read_range_into(shard, at, len, name, fill.area())?;
        Ok(fill
            .finish(lead + ulen)
            .slice(lead, ulen)
            .unwrap_or_default())
    }
}

/// Fill `area` from `file` at `at` in reads of at most [`MAX_READ`] bytes; past `need` bytes
/// the file may end. Returns the bytes read.
pub(crate) fn read_pieces(
    reads: &AtomicU64,
    fault: &FaultSlot,
    file: &File,
    area: &mut [MaybeUninit<u8>],
    at: u64,
    need: usize,
) -> std::io::Result<usize> {
    let mut done = 0usize;
    while done < area.len() {
        let take = (area.len() - done).min(MAX_READ);
        let piece_need = need.saturating_sub(done).min(take);
        let got = pread_counted(
            reads,
            fault,
            file,
            &mut area[done..done + take],
            at + done as u64,
            piece_need,
        )?;
        done += got;
        if got < take {
            break;
        }
    }
    Ok(done)
}

impl TensorData {
    /// Typed contents of raw little-endian bytes: BF16 and U8 stay in place, F32 is copied
    /// out and F16 widened to f32.
    #[must_use]
    pub fn from_bytes(dtype: Dtype, raw: Bytes) -> TensorData {
        match dtype {
            Dtype::F32 => TensorData::F32(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::Bf16 => TensorData::Bf16(U16s::new(raw)),
            Dtype::F16 => TensorData::F32(
                raw.chunks_exact(2)
                    .map(|c| crate::kernels::f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            Dtype::U8 => TensorData::U8(raw),
        }
    }
}

/// Positioned read into `buf` at `at`, counted in `reads` and subject to an injected fault:
/// retried on EINTR and on a short count until `buf` is full or, past `need` bytes, the file
/// ends. Returns the bytes read (`buf[..n]` is then initialised); end of file before `need`
/// bytes is an error.
pub(crate) fn pread_counted(
    reads: &AtomicU64,
    fault: &FaultSlot,
    file: &File,
    buf: &mut [MaybeUninit<u8>],
    at: u64,
    need: usize,
) -> std::io::Result<usize> {
    pread_seen(reads, fault, file, buf, at, need, |_| {})
}

/// [`pread_counted`], showing `seen` the bytes read, in order, as they arrive (to hash them
/// while they are still in the cache).
pub(crate) fn pread_seen(
    reads: &AtomicU64,
    fault: &FaultSlot,
    file: &File,
    buf: &mut [MaybeUninit<u8>],
    at: u64,
    need: usize,
    mut seen: impl FnMut(&[u8]),
) -> std::io::Result<usize> {
    use rustix::io::Errno;
    let n = reads.fetch_add(1, Ordering::Relaxed);
    let fault = fault.get(n);
    let mut done = 0usize;
    // First fill up to `limit`, then the rest: an injected short read stops half way.
    let mut limit = buf.len();
    match fault {
        Some(Fault::Io) => {
            return Err(std::io::Error::from(Errno::IO));
        }
        Some(Fault::Short) if need > 1 => {
            // Half of what is needed, rounded down to the alignment a direct read keeps.
            limit = if need >= 2 * DIRECT_ALIGN {
                need / 2 / DIRECT_ALIGN * DIRECT_ALIGN
            } else {
                need / 2
            };
        }
        // An interrupted call (or a first EIO) did nothing; the loop below is the retry.
        Some(Fault::Interrupted | Fault::Short | Fault::TransientIo) | None => {}
    }
    let mut retried_eio = matches!(fault, Some(Fault::TransientIo));
    loop {
        while done < limit {
            match rustix::io::pread(file, &mut buf[done..limit], at + done as u64) {
                Ok(([], _)) => {
                    if done >= need {
                        return Ok(done);
                    }
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the file ended before the tensor (truncated while in use?)",
                    ));
                }
                Ok((got, _)) => {
                    seen(got);
                    done += got.len();
                }
                Err(Errno::INTR) => {}
                // One bounded retry of an I/O error (a transient device hiccup); a second fails.
                Err(Errno::IO) if !retried_eio => retried_eio = true,
                Err(e) => return Err(e.into()),
            }
        }
        if limit == buf.len() {
            return Ok(done);
        }
        limit = buf.len();
    }
}

/// Read up to `buf.len()` bytes from the start of the file.
fn read_prefix(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
