//! Memory-mapped safetensors files: a single `*.safetensors` file or a sharded set with
//! `model.safetensors.index.json`. Tensors are byte ranges of the maps; nothing is copied.

use std::{collections::HashMap, fs::File, path::Path, sync::Arc};

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

/// All tensors of a checkpoint folder, by name.
pub struct SafeTensors {
    tensors: HashMap<String, TensorView>,
}

fn parse_file(path: &Path, out: &mut HashMap<String, TensorView>) -> Result<()> {
    let file = File::open(path).map_err(|e| Error::file(path, e))?;
    // SAFETY: the map is read-only; a checkpoint file changed underneath a running engine is
    // outside what any mmap-based loader (safetensors, MLX, llama.cpp) can guard against.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::file(path, format!("cannot map: {e}")))?;
    let map = Arc::new(map);
    if map.len() < 8 {
        return Err(Error::file(
            path,
            format!("not a safetensors file: {} bytes, no header", map.len()),
        ));
    }
    let n = u64::from_le_bytes(map[0..8].try_into().expect("8 bytes")) as usize;
    if n > map.len() - 8 || n > 100 << 20 {
        return Err(Error::file(
            path,
            format!(
                "corrupt safetensors header: length {n} in a file of {} bytes",
                map.len()
            ),
        ));
    }
    let header: Value = serde_json::from_slice(&map[8..8 + n])
        .map_err(|e| Error::file(path, format!("corrupt safetensors header: {e}")))?;
    let header = header
        .as_object()
        .ok_or_else(|| Error::file(path, "corrupt safetensors header: not a JSON object"))?;
    let data_start = 8 + n;
    let data_len = map.len() - data_start;
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let bad = |msg: &str| Error::file(path, format!("corrupt safetensors entry `{name}`: {msg}"));
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
                    .map(|d| d as usize)
                    .ok_or_else(|| bad("shape is not a list of integers"))
            })
            .collect::<Result<Vec<_>>>()?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no data_offsets"))?;
        let (begin, end) = match offsets.as_slice() {
            [a, b] => (
                a.as_u64().ok_or_else(|| bad("bad offset"))? as usize,
                b.as_u64().ok_or_else(|| bad("bad offset"))? as usize,
            ),
            _ => return Err(bad("data_offsets must have two entries")),
        };
        if begin > end || end > data_len {
            return Err(bad(&format!(
                "data [{begin}, {end}) lies outside the {data_len} data bytes (truncated file?)"
            )));
        }
        let dtype = DType::parse(dtype_name);
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("shape overflows"))?;
        if dtype != DType::Other && numel.checked_mul(dtype.size()) != Some(end - begin) {
            return Err(bad(&format!(
                "shape {shape:?} of {dtype_name} needs {} bytes, entry has {}",
                numel * dtype.size(),
                end - begin
            )));
        }
        let bytes = Bytes {
            map: map.clone(),
            start: data_start + begin,
            len: end - begin,
        };
        out.insert(
            name.clone(),
            TensorView {
                name: name.clone(),
                dtype,
                dtype_name: dtype_name.to_string(),
                shape,
                bytes,
            },
        );
    }
    Ok(())
}

impl SafeTensors {
    /// Open every shard of the checkpoint in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<std::path::PathBuf> = Vec::new();
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::file(&index, e))?;
            let v: Value =
                serde_json::from_str(&text).map_err(|e| Error::file(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::file(&index, "no `weight_map` object"))?;
            for f in map.values() {
                let f = f
                    .as_str()
                    .ok_or_else(|| Error::file(&index, format!("weight_map value {f} is not a file name")))?;
                let p = dir.join(f);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::file(dir, e))?;
            for entry in rd.flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "safetensors") {
                    files.push(p);
                }
            }
            files.sort();
        }
        if files.is_empty() {
            return Err(Error::file(dir, "no *.safetensors files in the checkpoint folder"));
        }
        let mut tensors = HashMap::new();
        for f in &files {
            if !f.exists() {
                return Err(Error::file(f, "listed in model.safetensors.index.json but missing"));
            }
            parse_file(f, &mut tensors)?;
        }
        Ok(SafeTensors { tensors })
    }

    pub fn get(&self, name: &str) -> Option<&TensorView> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A tensor that must exist.
    pub fn require(&self, name: &str) -> Result<&TensorView> {
        self.get(name)
            .ok_or_else(|| Error::weight(name, "missing from the checkpoint"))
    }
}
