//! Memory-mapped safetensors files: a single `*.safetensors` file or a sharded set with
//! `model.safetensors.index.json`. Tensors are byte ranges of the maps; nothing is copied.
//!
//! Validated as the format's own loader does ([`parse_header`]): every entry's byte range lies in
//! the data region, its size matches its dtype and shape, and the ranges tile the data region
//! exactly (no overlap, no gap, nothing after the last): a tensor that points into another's bytes
//! is refused, not read as garbage. Shards must be regular files (a FIFO would block `open`), a
//! tensor found in two shards follows the index (without one it is an error), and a missing shard
//! is told apart from a dangling symbolic link. The maps are only valid while the files stay as they
//! were: [`FileWatch`] notices a shard rewritten in place after loading (see its doc).

use std::{
    collections::HashMap,
    fs::File,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use memmap2::Mmap;
use serde_json::Value;

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    U32,
    /// Any other safetensors dtype: readable in the header, rejected where a tensor is used.
    Other,
}

impl DType {
    fn parse(s: &str) -> DType {
        match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "U32" => DType::U32,
            _ => DType::Other,
        }
    }
    /// Bytes per element of any dtype the format defines (None for names it does not know).
    fn size_of_name(s: &str) -> Option<usize> {
        Some(match s {
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
            "I16" | "U16" | "F16" | "BF16" => 2,
            "I32" | "U32" | "F32" => 4,
            "I64" | "U64" | "F64" => 8,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Other => 0,
        }
    }
}

/// A read-only byte range of a mapped checkpoint file.
#[derive(Clone)]
pub struct Bytes {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes held in an anonymous map (tests, converted tensors).
    pub fn from_slice(data: &[u8]) -> Bytes {
        let mut m = memmap2::MmapMut::map_anon(data.len().max(1)).expect("anonymous map");
        m[..data.len()].copy_from_slice(data);
        Bytes {
            map: Arc::new(m.make_read_only().expect("read-only map")),
            start: 0,
            len: data.len(),
        }
    }
    /// The sub-range `[offset, offset + len)` of this range.
    pub fn slice(&self, offset: usize, len: usize) -> Bytes {
        debug_assert!(offset + len <= self.len);
        Bytes {
            map: self.map.clone(),
            start: self.start + offset,
            len,
        }
    }
}

#[derive(Clone)]
pub struct TensorView {
    pub name: String,
    pub dtype: DType,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl TensorView {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor as f32 values (F32, F16 or BF16 storage).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes.as_slice();
        Ok(match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => {
                return Err(Error::weight(
                    &self.name,
                    format!(
                        "dtype {} where a float tensor (F32, F16, BF16) is expected",
                        self.dtype_name
                    ),
                ))
            }
        })
    }
}

/// One entry of a safetensors header: a tensor's dtype, shape and byte range in the data region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

/// The largest header the format allows (the reference loader's limit).
const MAX_HEADER: usize = 100 << 20;

/// Parse and validate a safetensors header (the JSON after the 8-byte length) describing a data
/// region of `data_len` bytes. Entries come back sorted by offset. The error says what is wrong
/// without the file name (the caller adds it).
pub fn parse_header(header: &[u8], data_len: usize) -> std::result::Result<Vec<Entry>, String> {
    if header.first() != Some(&b'{') {
        return Err("corrupt safetensors header: it must start with `{`".into());
    }
    let value: Value = serde_json::from_slice(header).map_err(|e| format!("corrupt safetensors header: {e}"))?;
    let obj = value
        .as_object()
        .ok_or("corrupt safetensors header: not a JSON object")?;
    let mut entries = Vec::with_capacity(obj.len());
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |msg: &str| format!("corrupt safetensors entry `{name}`: {msg}");
        let dtype_name = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no dtype"))?;
        let shape = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .and_then(|d| usize::try_from(d).ok())
                    .ok_or_else(|| bad("shape is not a list of integers"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no data_offsets"))?;
        let offset = |v: &Value| {
            v.as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| bad("bad offset"))
        };
        let (begin, end) = match offsets.as_slice() {
            [a, b] => (offset(a)?, offset(b)?),
            _ => return Err(bad("data_offsets must have two entries")),
        };
        if begin > end || end > data_len {
            return Err(bad(&format!(
                "data [{begin}, {end}) lies outside the {data_len} data bytes (truncated file?)"
            )));
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("shape overflows"))?;
        if let Some(size) = DType::size_of_name(dtype_name) {
            let need = numel.checked_mul(size).ok_or_else(|| bad("shape overflows"))?;
            if need != end - begin {
                return Err(bad(&format!(
                    "shape {shape:?} of {dtype_name} needs {need} bytes, entry has {}",
                    end - begin
                )));
            }
        }
        entries.push(Entry {
            name: name.clone(),
            dtype_name: dtype_name.to_string(),
            shape,
            begin,
            end,
        });
    }
    // The ranges must tile the data region: no overlap (one tensor read through another's bytes),
    // no gap, nothing left after the last.
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut at = 0usize;
    for e in &entries {
        if e.begin != at {
            return Err(if e.begin < at {
                format!(
                    "corrupt safetensors entry `{}`: its bytes [{}, {}) overlap the previous tensor's (which end at {at})",
                    e.name, e.begin, e.end
                )
            } else {
                format!(
                    "corrupt safetensors entry `{}`: {} unused bytes before it (data [{at}, {}) belongs to no tensor)",
                    e.name,
                    e.begin - at,
                    e.begin
                )
            });
        }
        at = e.end;
    }
    if at != data_len {
        return Err(format!(
            "corrupt safetensors file: the tensors cover {at} of the {data_len} data bytes"
        ));
    }
    Ok(entries)
}

/// Open a shard, refusing what is not a regular file (opening a FIFO blocks; a device can be
/// endless), and telling a dangling link from an absent file.
fn open_regular(path: &Path) -> Result<File> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(match std::fs::read_link(path) {
                Ok(target) => Error::file(
                    path,
                    format!(
                    "is a dangling symbolic link (to {}): the file it points to is missing (an interrupted download?)",
                    target.display()
                ),
                ),
                Err(_) => Error::file(path, "not found"),
            })
        }
        Err(e) => return Err(Error::file(path, e)),
    };
    if !meta.is_file() {
        return Err(Error::file(
            path,
            "not a regular file (a directory, FIFO or device): a checkpoint shard must be a file",
        ));
    }
    File::open(path).map_err(|e| Error::file(path, e))
}

/// One mapped shard: its tensors and what the file looked like when mapped.
struct Shard {
    path: PathBuf,
    tensors: Vec<TensorView>,
    watch: Watched,
}

fn parse_file(path: &Path) -> Result<Shard> {
    let file = open_regular(path)?;
    let watch = Watched::new(path, file)?;
    // SAFETY: the map is read-only. A file rewritten in place underneath a running engine is
    // outside what any mmap-based loader can fully guard against; `FileWatch::check` notices it
    // before each forward call (see its doc).
    let map = unsafe { Mmap::map(&watch.file) }.map_err(|e| Error::file(path, format!("cannot map: {e}")))?;
    let map = Arc::new(map);
    if map.len() < 8 {
        return Err(Error::file(
            path,
            format!("not a safetensors file: {} bytes, no header", map.len()),
        ));
    }
    let n = u64::from_le_bytes(map[0..8].try_into().expect("8 bytes"));
    let n = match usize::try_from(n) {
        Ok(n) if n <= map.len() - 8 && n <= MAX_HEADER => n,
        _ => {
            return Err(Error::file(
                path,
                format!(
                    "corrupt safetensors header: length {n} in a file of {} bytes",
                    map.len()
                ),
            ))
        }
    };
    let data_start = 8 + n;
    let entries = parse_header(&map[8..data_start], map.len() - data_start).map_err(|e| Error::file(path, e))?;
    let tensors = entries
        .into_iter()
        .map(|e| TensorView {
            dtype: DType::parse(&e.dtype_name),
            bytes: Bytes {
                map: map.clone(),
                start: data_start + e.begin,
                len: e.end - e.begin,
            },
            name: e.name,
            dtype_name: e.dtype_name,
            shape: e.shape,
        })
        .collect();
    Ok(Shard {
        path: path.to_path_buf(),
        tensors,
        watch,
    })
}

/// A mapped file and its size and modification time when it was mapped.
struct Watched {
    path: PathBuf,
    file: File,
    len: u64,
    modified: Option<SystemTime>,
}

impl Watched {
    fn new(path: &Path, file: File) -> Result<Watched> {
        let meta = file.metadata().map_err(|e| Error::file(path, e))?;
        Ok(Watched {
            path: path.to_path_buf(),
            file,
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }
}

/// The checkpoint files behind an engine's mapped weights. A file replaced by a new one (written
/// elsewhere and renamed over the old name, as `lily synth --force` and Hugging Face downloads do)
/// leaves the mapped old file intact: nothing changes for the engine. A file rewritten in place
/// (truncated and written again) invalidates the map: reading a page past the new end kills the
/// process with SIGBUS. [`FileWatch::check`] compares each open file's size and modification time
/// (one `fstat` per shard) before a forward pass and turns such a change into an error; it cannot
/// catch a rewrite that happens while a forward pass runs.
#[derive(Clone)]
pub struct FileWatch(Arc<Vec<Watched>>);

impl FileWatch {
    pub fn check(&self) -> Result<()> {
        for w in self.0.iter() {
            let meta = w.file.metadata().map_err(|e| Error::file(&w.path, e))?;
            if meta.len() != w.len || meta.modified().ok() != w.modified {
                return Err(Error::file(
                    &w.path,
                    "was modified on disk after the model was loaded; its weights can no longer be read safely: load the model again",
                ));
            }
        }
        Ok(())
    }
}

/// All tensors of a checkpoint folder, by name.
pub struct SafeTensors {
    tensors: HashMap<String, TensorView>,
    watch: FileWatch,
}

/// The shard files named by `model.safetensors.index.json`, and which shard holds each tensor.
fn read_index(dir: &Path, index: &Path) -> Result<(Vec<PathBuf>, HashMap<String, PathBuf>)> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::file(index, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::file(index, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::file(index, "no `weight_map` object"))?;
    let mut files = Vec::new();
    let mut owner = HashMap::with_capacity(map.len());
    for (name, f) in map {
        let f = f
            .as_str()
            .ok_or_else(|| Error::file(index, format!("weight_map value {f} is not a file name")))?;
        if f.is_empty() || Path::new(f).components().count() != 1 {
            return Err(Error::file(
                index,
                format!("weight_map names {f:?} for `{name}`: expected a file name inside the checkpoint folder"),
            ));
        }
        let p = dir.join(f);
        if !files.contains(&p) {
            files.push(p.clone());
        }
        owner.insert(name.clone(), p);
    }
    Ok((files, owner))
}

impl SafeTensors {
    /// Open every shard of the checkpoint in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let (files, owner) = if index.exists() {
            read_index(dir, &index)?
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::file(dir, e))?;
            let mut files: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            files.sort();
            (files, HashMap::new())
        };
        if files.is_empty() {
            return Err(Error::file(dir, "no *.safetensors files in the checkpoint folder"));
        }
        let mut tensors: HashMap<String, TensorView> = HashMap::new();
        let mut from: HashMap<String, PathBuf> = HashMap::new();
        let mut watched = Vec::with_capacity(files.len());
        for f in &files {
            if !owner.is_empty() && std::fs::symlink_metadata(f).is_err() {
                let example = owner.iter().find(|(_, p)| *p == f).map_or("", |(n, _)| n.as_str());
                return Err(Error::file(
                    f,
                    format!("listed in model.safetensors.index.json (e.g. for `{example}`) but not in the checkpoint folder"),
                ));
            }
            let shard = parse_file(f)?;
            for t in shard.tensors {
                match owner.get(&t.name) {
                    // The index decides which shard's copy is the tensor.
                    Some(p) if *p != shard.path => continue,
                    Some(_) => {}
                    None => {
                        if let Some(other) = from.get(&t.name) {
                            return Err(Error::weight(
                                &t.name,
                                format!(
                                    "present in two shards, {} and {}, and no index says which to use",
                                    other.display(),
                                    shard.path.display()
                                ),
                            ));
                        }
                    }
                }
                from.insert(t.name.clone(), shard.path.clone());
                tensors.insert(t.name.clone(), t);
            }
            watched.push(shard.watch);
        }
        if let Some((name, p)) = owner.iter().find(|(n, _)| !tensors.contains_key(*n)) {
            return Err(Error::weight(
                name,
                format!(
                    "model.safetensors.index.json places it in {}, which does not hold it",
                    p.display()
                ),
            ));
        }
        Ok(SafeTensors {
            tensors,
            watch: FileWatch(Arc::new(watched)),
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorView> {
        self.tensors.get(name)
    }

    /// Every tensor, in no particular order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorView> {
        self.tensors.values()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A tensor that must exist.
    pub fn require(&self, name: &str) -> Result<&TensorView> {
        self.get(name)
            .ok_or_else(|| Error::weight(name, "missing from the checkpoint"))
    }

    /// The files behind the mapped tensors, to check before using them.
    pub fn watch(&self) -> FileWatch {
        self.watch.clone()
    }
}
