//! Files a user names (text data, configurations): only regular files are opened, and no more
//! than a stated bound is read into memory. A FIFO with no writer blocks `open` forever, and
//! `/dev/zero` never ends, so both are refused by their type before anything is read; the bound
//! holds even where a file's size in its metadata is wrong (files under `/proc` say 0) or the
//! file grows while it is read.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::TrainError;

/// The most text data snug reads into memory (`--data FILE`, `snug prepare --input`): 4 GiB. A
/// text file is tokenized whole, so it costs its size and a few bytes per character more.
pub const MAX_TEXT_BYTES: u64 = 4 << 30;
/// The most a configuration file may hold: 16 MiB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// What `path` is, when it is not a regular file: `"a FIFO (named pipe)"`, `"a directory"`, ….
pub(crate) fn irregular_kind(file_type: std::fs::FileType) -> Option<&'static str> {
    if file_type.is_file() {
        return None;
    }
    if file_type.is_dir() {
        return Some("a directory");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if file_type.is_char_device() {
            return Some("a character device");
        }
        if file_type.is_block_device() {
            return Some("a block device");
        }
        if file_type.is_socket() {
            return Some("a socket");
        }
    }
    Some("not a regular file")
}

/// Fails unless `path` (after symbolic links) is a regular file; returns its size. Checked on
/// the path, before opening: opening a FIFO for reading waits for a writer.
pub fn check_regular(path: &Path) -> Result<u64, TrainError> {
    let meta = std::fs::metadata(path).map_err(|source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match irregular_kind(meta.file_type()) {
        None => Ok(meta.len()),
        Some(kind) => Err(TrainError::NotAFile {
            path: path.to_path_buf(),
            kind,
        }),
    }
}

/// Reads the regular file `path` as UTF-8 text of at most `limit` bytes; `what` names the kind of
/// file in the error (`"text data"`, `"a configuration"`).
pub fn read_text(path: &Path, limit: u64, what: &'static str) -> Result<String, TrainError> {
    let io = |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    };
    let too_large = || TrainError::TooLarge {
        path: path.to_path_buf(),
        what,
        limit,
    };
    let size = check_regular(path)?;
    if size > limit {
        return Err(too_large());
    }
    let file = File::open(path).map_err(io)?;
    // One byte past the limit tells a file that grew (or whose size was wrong) from one that
    // fits exactly.
    let mut bytes = Vec::with_capacity(size as usize + 1);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    String::from_utf8(bytes).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_whole_up_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        std::fs::write(&path, "héllo").unwrap();
        assert_eq!(read_text(&path, 6, "text data").unwrap(), "héllo");
        match read_text(&path, 5, "text data") {
            Err(TrainError::TooLarge {
                path: p,
                what: "text data",
                limit: 5,
            }) => assert_eq!(p, path),
            other => panic!("{other:?}"),
        }
        std::fs::write(&path, b"ab\xffcd").unwrap();
        let err = read_text(&path, 100, "text data").unwrap_err();
        assert!(
            matches!(&err, TrainError::Io { path: p, .. } if *p == path),
            "{err}"
        );
        let msg = anyhow_like(&err);
        assert!(msg.contains("offset 2"), "{msg}");
    }

    /// Files whose metadata says 0 bytes are still read with the bound.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_limit_holds_where_the_size_is_wrong() {
        let maps = Path::new("/proc/self/maps");
        assert_eq!(std::fs::metadata(maps).unwrap().len(), 0);
        assert!(matches!(
            read_text(maps, 10, "text data"),
            Err(TrainError::TooLarge { limit: 10, .. })
        ));
        assert!(!read_text(maps, 1 << 20, "text data").unwrap().is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn devices_directories_and_fifos_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (path, kind) in [
            (Path::new("/dev/zero"), "a character device"),
            (fifo.as_path(), "a FIFO (named pipe)"),
            (dir.path(), "a directory"),
        ] {
            let err = read_text(path, MAX_TEXT_BYTES, "text data").unwrap_err();
            assert!(
                matches!(&err, TrainError::NotAFile { path: p, kind: k } if p == path && *k == kind),
                "{err:?}"
            );
            let msg = err.to_string();
            assert!(msg.starts_with(&path.display().to_string()), "{msg}");
            assert!(msg.contains(kind), "{msg}");
        }
    }

    /// The error and its sources, as `{:#}` of anyhow prints them.
    fn anyhow_like(e: &TrainError) -> String {
        let mut s = e.to_string();
        let mut src = std::error::Error::source(e);
        while let Some(cause) = src {
            s += &format!(": {cause}");
            src = cause.source();
        }
        s
    }
}
