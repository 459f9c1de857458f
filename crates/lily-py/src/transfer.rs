//! A sequence's state between `lily_core::engine::SequenceState` and Python: token ids, the KV
//! dtype's name, and a dict of numpy arrays named `layers.{i}.k` / `.v` ([position, Hkv * hd]:
//! uint16 bit patterns of a bf16 / f16 cache, float32 of an f32 one) and `layers.{i}.conv` /
//! `.ssm` (float32, flat): what `Engine.export_sequence` returns and `import_sequence` takes,
//! ready for a safetensors file.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
    types::PyDict,
};

use lily_core::{
    backend::KvDtype,
    config::LayerKind,
    engine::{LayerData, SequenceState},
};

/// The Python form of `st`, K/V arrays of `width` columns.
pub fn to_python<'py>(
    py: Python<'py>,
    st: SequenceState,
    width: usize,
) -> PyResult<(Vec<u32>, &'static str, Bound<'py, PyDict>)> {
    let SequenceState {
        tokens,
        first_row,
        kv_dtype,
        layers,
    } = st;
    let rows = tokens.len() - first_row;
    let tensors = PyDict::new(py);
    for (i, layer) in layers.into_iter().enumerate() {
        match layer {
            LayerData::Attention { k, v } => {
                for (name, bytes) in [("k", k), ("v", v)] {
                    let arr = match kv_dtype {
                        KvDtype::F32 => PyArray1::from_vec(py, le_values(&bytes, f32::from_le_bytes))
                            .reshape([rows, width])?
                            .into_any(),
                        KvDtype::BF16 | KvDtype::F16 => PyArray1::from_vec(py, le_values(&bytes, u16::from_le_bytes))
                            .reshape([rows, width])?
                            .into_any(),
                    };
                    tensors.set_item(format!("layers.{i}.{name}"), arr)?;
                }
            }
            LayerData::DeltaNet { conv, ssm } => {
                tensors.set_item(format!("layers.{i}.conv"), PyArray1::from_vec(py, conv))?;
                tensors.set_item(format!("layers.{i}.ssm"), PyArray1::from_vec(py, ssm))?;
            }
        }
    }
    Ok((tokens, kv_dtype.name(), tensors))
}

/// `SequenceState` from its Python form, for a model whose layers are `kinds`. Names, dtypes and
/// row counts are checked here; sizes against the model by the engine.
pub fn from_python(
    tokens: Vec<i64>,
    kv_dtype: &str,
    tensors: &Bound<'_, PyDict>,
    kinds: &[LayerKind],
) -> PyResult<SequenceState> {
    let kv_dtype = KvDtype::parse(kv_dtype).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let tokens = tokens
        .into_iter()
        .map(|t| u32::try_from(t).map_err(|_| PyValueError::new_err(format!("token id {t} out of range"))))
        .collect::<PyResult<Vec<u32>>>()?;
    let expected = |i: usize, kind: &LayerKind| match kind {
        LayerKind::Attention => [format!("layers.{i}.k"), format!("layers.{i}.v")],
        LayerKind::DeltaNet => [format!("layers.{i}.conv"), format!("layers.{i}.ssm")],
    };
    let known: Vec<String> = kinds.iter().enumerate().flat_map(|(i, k)| expected(i, k)).collect();
    for key in tensors.keys() {
        let key: String = key.extract()?;
        if !known.contains(&key) {
            return Err(PyValueError::new_err(format!(
                "sequence state has a tensor {key:?} that this model ({} layers) does not have",
                kinds.len()
            )));
        }
    }
    let get = |name: &str| {
        tensors
            .get_item(name)?
            .ok_or_else(|| PyValueError::new_err(format!("sequence state lacks tensor {name:?}")))
    };
    let mut layers = Vec::with_capacity(kinds.len());
    for (i, kind) in kinds.iter().enumerate() {
        let [a, b] = expected(i, kind);
        layers.push(match kind {
            LayerKind::Attention => LayerData::Attention {
                k: kv_bytes(&a, &get(&a)?, kv_dtype, tokens.len())?,
                v: kv_bytes(&b, &get(&b)?, kv_dtype, tokens.len())?,
            },
            LayerKind::DeltaNet => LayerData::DeltaNet {
                conv: f32_values(&a, &get(&a)?)?,
                ssm: f32_values(&b, &get(&b)?)?,
            },
        });
    }
    Ok(SequenceState {
        tokens,
        first_row: 0,
        kv_dtype,
        layers,
    })
}

/// Little-endian values of `N` bytes each.
fn le_values<T, const N: usize>(bytes: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| from(c.try_into().expect("chunks of N")))
        .collect()
}

/// A [rows, width] array of the cache dtype's storage type as little-endian bytes.
fn kv_bytes(name: &str, obj: &Bound<'_, PyAny>, dtype: KvDtype, rows: usize) -> PyResult<Vec<u8>> {
    let (bytes, shape) = match dtype {
        KvDtype::F32 => {
            let a: PyReadonlyArrayDyn<f32> = typed(name, obj, "float32")?;
            let bytes = a.as_array().iter().flat_map(|x| x.to_le_bytes()).collect();
            (bytes, a.shape().to_vec())
        }
        KvDtype::BF16 | KvDtype::F16 => {
            let a: PyReadonlyArrayDyn<u16> = typed(name, obj, "uint16 (bit patterns)")?;
            let bytes = a.as_array().iter().flat_map(|x| x.to_le_bytes()).collect();
            (bytes, a.shape().to_vec())
        }
    };
    if shape.len() != 2 || shape[0] != rows {
        return Err(PyValueError::new_err(format!(
            "sequence state tensor {name:?} has shape {shape:?}, expected [{rows}, width] (one row per token)"
        )));
    }
    Ok(bytes)
}

fn f32_values(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    let a: PyReadonlyArrayDyn<f32> = typed(name, obj, "float32")?;
    Ok(a.as_array().iter().copied().collect())
}

fn typed<'py, T: numpy::Element>(
    name: &str,
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "sequence state tensor {name:?} must be a numpy array of {what}"
        ))
    })
}
