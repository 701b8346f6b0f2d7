//! The embedded demo model: a small model with the Kimi K3 tensor graph and tokenizer
//! (trained by `tools/demo/`), compiled into the binary so `k3 chat` answers on a fresh
//! machine. It is written once into the user cache directory (a directory named by the
//! files' digest, created atomically) and then read through the normal checkpoint reader.

use crate::stream::atomic::PendingDir;
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The files of the demo checkpoint.
pub const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../assets/demo/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../assets/demo/generation_config.json"),
    ),
    (
        "model-00001-of-000002.safetensors",
        include_bytes!("../../assets/demo/model-00001-of-000002.safetensors"),
    ),
    (
        "model-00002-of-000002.safetensors",
        include_bytes!("../../assets/demo/model-00002-of-000002.safetensors"),
    ),
    (
        "model.safetensors.index.json",
        include_bytes!("../../assets/demo/model.safetensors.index.json"),
    ),
    (
        "tiktoken.model",
        include_bytes!("../../assets/demo/tiktoken.model"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../assets/demo/tokenizer_config.json"),
    ),
];

/// Total bytes of the embedded files.
#[must_use]
pub fn size() -> usize {
    FILES.iter().map(|(_, b)| b.len()).sum()
}

/// SHA-256 (hex) over the file names and contents.
#[must_use]
pub fn digest() -> String {
    let mut h = Sha256::new();
    for (name, bytes) in FILES {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Where the demo model is materialised: `$K3_CACHE_DIR`, else the user cache directory.
#[must_use]
pub fn cache_root() -> PathBuf {
    match std::env::var_os("K3_CACHE_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => directories::ProjectDirs::from("", "", "k3").map_or_else(
            || std::env::temp_dir().join("k3-cache"),
            |d| d.cache_dir().to_path_buf(),
        ),
    }
}

/// Whether `dir` holds exactly the embedded files.
fn intact(dir: &Path) -> bool {
    FILES.iter().all(|(name, bytes)| {
        std::fs::read(dir.join(name)).is_ok_and(|have| have.as_slice() == *bytes)
    })
}

/// The demo checkpoint directory, written under `root` if it is not there yet (or damaged).
pub fn materialise_in(root: &Path) -> Result<PathBuf> {
    let dir = root.join(format!("demo-{}", &digest()[..16]));
    if intact(&dir) {
        return Ok(dir);
    }
    let werr = |path: &Path| {
        let path = path.display().to_string();
        move |source| Error::Write {
            path: path.clone(),
            source,
        }
    };
    std::fs::create_dir_all(root).map_err(werr(root))?;
    let tmp = PendingDir::new(&dir).map_err(werr(root))?;
    for (name, bytes) in FILES {
        let p = tmp.path().join(name);
        let mut f = std::fs::File::create(&p).map_err(werr(&p))?;
        f.write_all(bytes).map_err(werr(&p))?;
        f.sync_all().map_err(werr(&p))?;
    }
    if dir.exists() {
        // A damaged copy: replace it.
        let _ = std::fs::remove_dir_all(&dir);
    }
    if let Err(e) = tmp.commit() {
        // Another process may have put an intact copy there first.
        if !intact(&dir) {
            return Err(werr(&dir)(e));
        }
    }
    Ok(dir)
}

/// The demo checkpoint directory in the cache root.
pub fn materialise() -> Result<PathBuf> {
    materialise_in(&cache_root())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn materialises_once_and_repairs_damage() {
        let tmp = tempfile::tempdir().unwrap();
        let a = materialise_in(tmp.path()).unwrap();
        assert!(intact(&a));
        let mtime = std::fs::metadata(a.join("config.json"))
            .unwrap()
            .modified()
            .unwrap();
        let b = materialise_in(tmp.path()).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            std::fs::metadata(b.join("config.json"))
                .unwrap()
                .modified()
                .unwrap(),
            mtime,
            "an intact copy is reused, not rewritten"
        );
        std::fs::write(a.join("tiktoken.model"), b"damaged").unwrap();
        let c = materialise_in(tmp.path()).unwrap();
        assert_eq!(a, c);
        assert!(intact(&c));
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "{left:?}");
    }

    #[test]
    fn an_unwritable_cache_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = materialise_in(&file.join("sub")).unwrap_err();
        assert_eq!(e.exit_code(), 1);
        assert!(e.to_string().contains("cannot write"), "{e}");
    }

    #[test]
    fn the_demo_fits_the_size_limit() {
        assert!(size() <= 25_000_000, "{} bytes", size());
    }
}
