//! The bytes of a parameter struct (`backend/params.rs`) as a dispatch binds them ([`bytes_of`]:
//! inline, no allocation).

use crate::backend::params::Param;

/// The bytes of one parameter struct, held inline (no allocation): what a dispatch binds with
/// `setBytes`. 4-byte aligned, so a kernel (or the simulator) can read the struct in place.
#[derive(Clone, Copy)]
pub struct ParamBytes {
    len: usize,
    words: [u32; ParamBytes::MAX / 4],
}

impl ParamBytes {
    /// The largest parameter struct (`RopeParams`, `MatrixDesc`).
    pub const MAX: usize = 32;

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` <= MAX bytes of `words`, all initialized.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }

    /// The first byte, writable (for an executor that hands the bytes to C by a mutable pointer).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr() as *mut u8
    }
}

impl std::fmt::Debug for ParamBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ParamBytes").field(&self.as_slice()).finish()
    }
}

/// The bytes of a parameter struct, for `setBytes`, copied onto the stack.
pub fn bytes_of<T: Param>(v: &T) -> ParamBytes {
    const {
        assert!(size_of::<T>() <= ParamBytes::MAX && size_of::<T>() % 4 == 0);
    }
    let mut words = [0u32; ParamBytes::MAX / 4];
    // SAFETY: T is a padding-free parameter struct (`Param`) of at most MAX bytes, so every one
    // of its size_of::<T>() bytes is initialized and fits in `words`.
    unsafe {
        std::ptr::copy_nonoverlapping(
            v as *const T as *const u8,
            words.as_mut_ptr() as *mut u8,
            size_of::<T>(),
        )
    };
    ParamBytes {
        len: size_of::<T>(),
        words,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::params::{EmbedParams, MatrixDesc};

    #[test]
    fn param_bytes_hold_the_struct() {
        let d = MatrixDesc {
            rows: 1,
            cols: 2,
            expert_stride: 3,
            row_offset: 4,
            group: 5,
            pad0: 6,
            pad1: 7,
            pad2: 8,
        };
        let b = bytes_of(&d);
        assert_eq!(b.as_slice().len(), 32);
        let words: Vec<u32> = b
            .as_slice()
            .chunks(4)
            .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, [1, 2, 3, 4, 5, 6, 7, 8]);
        let e = bytes_of(&EmbedParams { tokens: 9 });
        assert_eq!(e.as_slice(), 9u32.to_ne_bytes());
        assert_eq!(e.as_slice().as_ptr() as usize % 4, 0);
    }
}
