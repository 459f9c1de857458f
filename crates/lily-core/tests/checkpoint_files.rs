//! The safetensors contract and the checkpoint-file checks of `safetensors.rs`: byte ranges that
//! overlap, leave gaps or stop short of the data are refused (as the format's reference loader
//! refuses them); shards that are not regular files, dangling links, tensors present in two shards
//! and an index that points at the wrong shard are typed errors naming the file; a shard rewritten
//! in place after loading is noticed before the next use, one replaced by rename is not a problem.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

use lily_core::safetensors::{parse_header, SafeTensors};

/// A fresh empty folder under the system temp dir (removed when dropped).
struct Dir(PathBuf);
impl Dir {
    fn new(tag: &str) -> Dir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "lily-ckpt-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file from (name, dtype, shape, begin, end) entries and `data_len` data bytes.
fn file_bytes(entries: &[(&str, &str, &[usize], usize, usize)], data_len: usize) -> Vec<u8> {
    let mut header = String::from("{");
    for (i, (name, dtype, shape, b, e)) in entries.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{b},{e}]}}"
        ));
    }
    header.push('}');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend((0..data_len).map(|i| i as u8));
    out
}

fn header_of(entries: &[(&str, &str, &[usize], usize, usize)], data_len: usize) -> Result<usize, String> {
    let bytes = file_bytes(entries, data_len);
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    parse_header(&bytes[8..8 + n], data_len).map(|e| e.len())
}

#[test]
fn ranges_must_tile_the_data() {
    // Two F32 [2] tensors back to back: fine, in any header order.
    assert_eq!(
        header_of(&[("b", "F32", &[2], 8, 16), ("a", "F32", &[2], 0, 8)], 16),
        Ok(2)
    );
    // A norm that points into the embedding's bytes (the issue's example): refused.
    let e = header_of(&[("embed", "F32", &[4], 0, 16), ("norm", "F32", &[2], 8, 16)], 16).unwrap_err();
    assert!(e.contains("norm") && e.contains("overlap"), "{e}");
    // A gap between tensors, and bytes after the last one.
    let e = header_of(&[("a", "F32", &[2], 0, 8), ("b", "F32", &[2], 12, 20)], 20).unwrap_err();
    assert!(e.contains("unused") && e.contains('b'), "{e}");
    let e = header_of(&[("a", "F32", &[2], 0, 8)], 12).unwrap_err();
    assert!(e.contains("cover 8 of the 12"), "{e}");
    // Size must match dtype x shape for any dtype the format defines, not only the ones we read.
    let e = header_of(&[("a", "I64", &[2], 0, 8)], 8).unwrap_err();
    assert!(e.contains("needs 16 bytes"), "{e}");
    // Zero-sized tensors sit anywhere in the tiling.
    assert_eq!(
        header_of(&[("z", "F32", &[0], 8, 8), ("a", "F32", &[2], 0, 8)], 8),
        Ok(2)
    );
}

#[test]
fn header_values_out_of_range_are_errors() {
    for bad in [
        &br#"{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,8]}}"#[..],
        br#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}}"#,
        br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
        br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}}"#,
        br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1e30]}}"#,
        br#"{"a":{"shape":[2],"data_offsets":[0,8]}}"#,
        br#"[1, 2]"#,
        br#"{"a": 1"#,
        b"",
    ] {
        assert!(
            parse_header(bad, 8).is_err(),
            "accepted {}",
            String::from_utf8_lossy(bad)
        );
    }
}

fn write(dir: &Dir, name: &str, entries: &[(&str, &str, &[usize], usize, usize)], data_len: usize) -> PathBuf {
    let p = dir.path(name);
    fs::write(&p, file_bytes(entries, data_len)).unwrap();
    p
}

fn open_err(dir: &Path) -> String {
    match SafeTensors::open_dir(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
#[cfg(unix)]
fn a_shard_that_is_not_a_regular_file_is_refused_without_blocking() {
    let d = Dir::new("fifo");
    let fifo = d.path("model.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    extern "C" {
        fn mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { mkfifo(c.as_ptr(), 0o600) }, 0);
    // Opening a FIFO for reading blocks until a writer comes: the loader must not open it.
    let e = open_err(&d.0);
    assert!(
        e.contains("not a regular file") && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
#[cfg(unix)]
fn missing_shard_and_dangling_link_are_told_apart() {
    let d = Dir::new("links");
    write(&d, "a.safetensors", &[("x", "F32", &[2], 0, 8)], 8);
    let index = r#"{"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}"#;
    fs::write(d.path("model.safetensors.index.json"), index).unwrap();
    let e = open_err(&d.0);
    assert!(
        e.contains("b.safetensors") && e.contains("not in the checkpoint folder"),
        "{e}"
    );
    std::os::unix::fs::symlink(d.path("blobs-gone"), d.path("b.safetensors")).unwrap();
    let e = open_err(&d.0);
    assert!(e.contains("dangling symbolic link") && e.contains("blobs-gone"), "{e}");
}

#[test]
fn a_tensor_in_two_shards_follows_the_index_or_is_an_error() {
    let d = Dir::new("dup");
    write(&d, "a.safetensors", &[("x", "F32", &[2], 0, 8)], 8);
    write(
        &d,
        "b.safetensors",
        &[("x", "F32", &[1], 0, 4), ("y", "F32", &[1], 4, 8)],
        8,
    );
    // No index: which copy is meant is unknown.
    let e = open_err(&d.0);
    assert!(e.contains("`x`") && e.contains("two shards"), "{e}");
    // The index says b: b's one-element x is the tensor.
    fs::write(
        d.path("model.safetensors.index.json"),
        r#"{"weight_map": {"x": "b.safetensors", "y": "b.safetensors"}}"#,
    )
    .unwrap();
    let st = SafeTensors::open_dir(&d.0).unwrap();
    assert_eq!(st.get("x").unwrap().shape, vec![1]);
    // An index that names a shard without the tensor.
    fs::write(
        d.path("model.safetensors.index.json"),
        r#"{"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}"#,
    )
    .unwrap();
    let e = open_err(&d.0);
    assert!(e.contains("`y`") && e.contains("does not hold it"), "{e}");
    // An index entry that is a path out of the folder.
    fs::write(
        d.path("model.safetensors.index.json"),
        r#"{"weight_map": {"x": "../a.safetensors"}}"#,
    )
    .unwrap();
    let e = open_err(&d.0);
    assert!(e.contains("../a.safetensors"), "{e}");
}

#[test]
fn a_shard_rewritten_in_place_is_noticed_and_a_replaced_one_is_not_a_problem() {
    let d = Dir::new("watch");
    let p = write(&d, "model.safetensors", &[("x", "F32", &[4], 0, 16)], 16);
    let st = SafeTensors::open_dir(&d.0).unwrap();
    let watch = st.watch();
    watch.check().unwrap();
    // Replaced by rename (a new file under the old name): the map still reads the old file.
    let tmp = write(&d, "new.tmp", &[("x", "F32", &[2], 0, 8)], 8);
    fs::rename(&tmp, &p).unwrap();
    watch.check().unwrap();
    assert_eq!(st.get("x").unwrap().to_f32().unwrap().len(), 4);
    // Rewritten in place (the same file, truncated): an error naming it.
    let st = SafeTensors::open_dir(&d.0).unwrap();
    let watch = st.watch();
    fs::write(&p, b"12345678").unwrap();
    let e = watch.check().unwrap_err().to_string();
    assert!(e.contains("model.safetensors") && e.contains("modified on disk"), "{e}");
}
