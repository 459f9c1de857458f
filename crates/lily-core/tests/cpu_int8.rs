//! The integer-activation 4-bit dot ([`int8`]): every kernel this CPU has against the portable
//! twin, the activation planes against their error bound, and the kernel choice per shape; in
//! both precisions (three planes: exact to f32; one plane: the fast mode, within half a step of x).
//! On arm64 (CI runs this file under qemu) the `sdot` kernel is among them.

mod common;

use common::{float_bytes, rand_vec};
use lily_core::{
    backend::cpu::{
        int8::{self, Dot, Planes, Precision, Rows, CHUNK_GROUPS, PLANES},
        isa::Isa,
    },
    quant::read_scalar,
    safetensors::DType,
};

/// Random packed 4-bit codes.
fn codes(n_bytes: usize, seed: u64) -> Vec<u8> {
    rand_vec(n_bytes, seed, 0.0, 256.0)
        .into_iter()
        .map(|v| v as u8)
        .collect()
}

/// x with a few large outliers, as real activations have.
fn activations(cols: usize, seed: u64) -> Vec<f32> {
    let mut x = rand_vec(cols, seed, -1.0, 1.0);
    for i in (0..cols).step_by(97) {
        x[i] *= 60.0;
    }
    x
}

/// The lane scales of [`int8::dot`]: s_g d_g for each 8-element lane of a row.
fn lane_scales(s: &[f32], dx: &[f32], group: usize) -> Vec<f32> {
    s.iter().zip(dx).flat_map(|(s, d)| vec![s * d; group / 8]).collect()
}

/// Both precisions' plane counts.
const MODES: [usize; 2] = [PLANES, 1];

/// Element i of x rebuilt from `n` planes of `dot`'s layout (`int8::x_pos`, x rows of `cols`):
/// d_g (q0 + q1 / 256 + q2 / 256^2).
fn rebuilt(dot: Dot, n: usize, cols: usize, xq: &[i8], dx: &[f32], group: usize, i: usize) -> f32 {
    let pos = int8::x_pos(dot, n, cols, i);
    let mut v = 0f64;
    for p in 0..n {
        v += xq[pos + p * 2 * dot.block()] as f64 / 256f64.powi(p as i32);
    }
    (v * dx[i / group] as f64) as f32
}

#[test]
fn precision_names_parse_and_bad_ones_are_typed_errors() {
    for p in [Precision::Exact, Precision::Fast] {
        assert_eq!(Precision::parse(p.name()).unwrap(), p);
    }
    assert_eq!((Precision::Exact.planes(), Precision::Fast.planes()), (PLANES, 1));
    for bad in ["", "Fast", "int8", "exact "] {
        let e = Precision::parse(bad).unwrap_err();
        assert!(matches!(e, lily_core::Error::InvalidArgument(_)), "{bad:?}: {e}");
    }
}

#[test]
fn planes_rebuild_x_within_their_bound() {
    for (dot, n) in Dot::all_available().into_iter().flat_map(|d| MODES.map(|n| (d, n))) {
        for group in [32, 64, 128] {
            let cols = 4 * 128;
            let x = activations(cols, group as u64);
            let (mut dx, mut xq) = (vec![0f32; cols / group], vec![0i8; n * cols]);
            int8::quantize(Isa::get(), dot, n, &x, group, &mut dx, &mut xq);
            for (g, xg) in x.chunks_exact(group).enumerate() {
                let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!((dx[g] - amax / 127.0).abs() <= 1e-7 * amax, "{dot:?} step of group {g}");
                // Half a step of the last plane, plus f32 rounding of the rebuilt value.
                let bound = amax / (127.0 * 2.0 * 256f32.powi(n as i32 - 1)) + 1.2e-7 * amax;
                for (j, &v) in xg.iter().enumerate() {
                    let i = g * group + j;
                    let err = (rebuilt(dot, n, cols, &xq, &dx, group, i) - v).abs();
                    assert!(
                        err <= bound,
                        "{dot:?} {n} planes, group {group}: element {i} off by {err:e} (bound {bound:e})"
                    );
                }
            }
        }
    }
}

#[test]
fn zero_and_tiny_groups_quantize_without_nan() {
    let dot = Dot::pick(Isa::get(), 256).unwrap();
    let mut x = vec![0f32; 256];
    x[64..128].iter_mut().for_each(|v| *v = 1e-30);
    let (mut dx, mut xq) = (vec![f32::NAN; 4], vec![1i8; PLANES * 256]);
    int8::quantize(Isa::get(), dot, PLANES, &x, 64, &mut dx, &mut xq);
    assert_eq!(dx[0], 0.0);
    assert!(dx.iter().all(|d| d.is_finite()));
    let w = codes(128, 3);
    let cl = lane_scales(&[1.0; 4], &dx, 64);
    let y = int8::dot(dot, PLANES, &w, &xq, &cl);
    assert!(y.is_finite() && y.abs() < 1e-25, "{y}");
}

#[test]
fn every_dot_kernel_matches_the_portable_twin() {
    for (dot, n) in Dot::all_available().into_iter().flat_map(|d| MODES.map(|n| (d, n))) {
        let b = dot.block();
        // One block, an odd number (the unrolled loop's tail), a real row (2048).
        for cols in [2 * b, 6 * b, 10 * b, 2048] {
            for group in [32, 64, 128] {
                if cols % group != 0 {
                    continue;
                }
                let x = activations(cols, cols as u64);
                let (mut dx, mut xq) = (vec![0f32; cols / group], vec![0i8; n * cols]);
                int8::quantize(Isa::get(), dot, n, &x, group, &mut dx, &mut xq);
                let w = codes(cols / 2, 7 + cols as u64);
                let s = rand_vec(cols / group, 9, 0.001, 0.02);
                let cl = lane_scales(&s, &dx, group);
                let got = int8::dot(dot, n, &w, &xq, &cl);
                let want = int8::dot_portable(dot, n, &w, &xq, &cl);
                // Same integer lane sums; only the f32 order of the lane totals differs.
                let mag: f32 = cl.iter().map(|c| c.abs()).sum::<f32>() * 8.0 * 15.0 * 127.0;
                assert!(
                    (got - want).abs() <= 1e-6 * mag,
                    "{dot:?} {n} planes, cols {cols} group {group}: {got} vs {want}"
                );
                // And the exact product of the codes with x, sum_j s_g q_j x_j (the affine
                // bias term is added outside the kernel), within x's rounding: half a step of
                // the last plane per element (one plane: sum_j s_g q_j d_g / 2).
                let exact: f64 = (0..cols)
                    .map(|j| {
                        let q = if j % 2 == 0 { w[j / 2] & 15 } else { w[j / 2] >> 4 };
                        s[j / group] as f64 * q as f64 * x[j] as f64
                    })
                    .sum();
                let scale: f64 = (0..cols).map(|j| s[j / group] as f64 * 15.0 * x[j].abs() as f64).sum();
                let rounding: f64 = (0..cols)
                    .map(|j| {
                        let q = if j % 2 == 0 { w[j / 2] & 15 } else { w[j / 2] >> 4 };
                        s[j / group] as f64 * q as f64 * dx[j / group] as f64 / (2.0 * 256f64.powi(n as i32 - 1))
                    })
                    .sum();
                assert!(
                    (got as f64 - exact).abs() <= 1e-6 * scale + rounding,
                    "{dot:?} {n} planes, cols {cols} group {group}: {got} vs exact {exact}"
                );
            }
        }
    }
}

#[test]
fn the_pick_fits_the_shape_and_the_isa() {
    for isa in Isa::all_available() {
        for cols in [32, 64, 96, 128, 2048, 4096 + 32] {
            let dot = Dot::pick(isa, cols).expect("every multiple of 32 has a kernel");
            assert!(dot.available());
            assert_eq!(cols % (2 * dot.block()), 0, "{isa:?} {cols} -> {dot:?}");
        }
        assert_eq!(Dot::pick(isa, 48), None);
    }
    assert_eq!(Dot::pick(Isa::Portable, 2048).map(|d| d.block()), Some(16));
    // CI names the kernels its machines must have, so a detection bug cannot skip one silently.
    for want in std::env::var("LILY_EXPECT_DOTS")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let all = Dot::all_available();
        assert!(
            all.iter().any(|d| format!("{d:?}") == want),
            "{want} not available: {all:?}"
        );
    }
}

/// `n` 4-bit rows of `cols` (random codes from `seed`), their scales and biases in `dtype` per
/// `group` columns.
struct Packed {
    w: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
    dtype: DType,
    cols: usize,
    group: usize,
}

impl Packed {
    fn new(n: usize, cols: usize, group: usize, dtype: DType, seed: u64) -> Self {
        let g_n = cols / group;
        Packed {
            w: codes(n * cols / 2, seed),
            scales: float_bytes(&rand_vec(n * g_n, 5, 0.001, 0.02), dtype),
            biases: float_bytes(&rand_vec(n * g_n, 6, -0.1, 0.1), dtype),
            dtype,
            cols,
            group,
        }
    }

    fn rows(&self) -> Rows<'_> {
        Rows {
            w: &self.w,
            scales: &self.scales,
            biases: &self.biases,
            dtype: self.dtype,
            cols: self.cols,
            group: self.group,
        }
    }

    /// Row r times x: the exact affine product in f64, the scale of its terms, and the bound of
    /// x's rounding in `np` planes of steps `dx` (per group: half a step of the last plane per
    /// element; the bias term uses exact group sums).
    fn exact(&self, r: usize, x: &[f32], dx: &[f32], np: usize) -> (f64, f64, f64) {
        let (cols, group, g_n) = (self.cols, self.group, self.cols / self.group);
        let (mut exact, mut mag, mut rounding) = (0f64, 0f64, 0f64);
        for j in 0..cols {
            let byte = self.w[r * cols / 2 + j / 2];
            let q = if j % 2 == 0 { byte & 15 } else { byte >> 4 } as f64;
            let s = read_scalar(self.dtype, &self.scales, r * g_n + j / group) as f64;
            let b = read_scalar(self.dtype, &self.biases, r * g_n + j / group) as f64;
            let x = x[j] as f64;
            exact += (s * q + b) * x;
            mag += (s * q + b.abs()) * x.abs();
            rounding += s * q * dx[j / group] as f64 / (2.0 * 256f64.powi(np as i32 - 1));
        }
        (exact, mag, rounding)
    }
}

#[test]
fn every_rows_kernel_matches_the_twin_and_the_exact_product() {
    // Quarters of 9 rows (the kernels run four streams) and a tail row.
    let n = 37;
    for (dot, np) in Dot::all_available().into_iter().flat_map(|d| MODES.map(|n| (d, n))) {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            // Groups of MLX (fused on x86 and arm64) and a larger one (the lane-by-lane twin path); rows of
            // fewer groups than a chunk (512), whole chunks (2048), and a partial last chunk.
            for group in [32, 64, 128, 256] {
                for cols in [512, 1536, 2048, 4096 + 512] {
                    if cols % group != 0 || cols % (2 * dot.block()) != 0 {
                        continue;
                    }
                    let what = format!("{dot:?} {np} planes {dtype:?} group {group} cols {cols}");
                    let g_n = cols / group;
                    let g_pad = g_n.next_multiple_of(CHUNK_GROUPS);
                    let x = activations(cols, cols as u64 + group as u64);
                    let (mut dx, mut xq) = (vec![0f32; g_pad], vec![0i8; np * cols]);
                    int8::quantize(Isa::get(), dot, np, &x, group, &mut dx[..g_n], &mut xq);
                    let mut gsum = vec![0f32; g_pad];
                    for (g, xg) in x.chunks_exact(group).enumerate() {
                        gsum[g] = xg.iter().sum();
                    }
                    let m = Packed::new(n, cols, group, dtype, 11 + cols as u64);
                    let rows = m.rows();
                    let planes = Planes {
                        dot,
                        n: np,
                        dx: &dx,
                        gsum: &gsum,
                        xq: &xq,
                    };
                    let (mut got, mut twin) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                    int8::rows(&rows, &planes, &mut got);
                    int8::rows_portable(&rows, &planes, &mut twin);
                    for r in 0..n {
                        let (exact, mag, rounding) = m.exact(r, &x, &dx, np);
                        for (v, name) in [(got[r], "kernel"), (twin[r], "twin")] {
                            assert!(
                                (v as f64 - exact).abs() <= 2e-6 * mag + rounding,
                                "{what} row {r}: {name} {v} vs exact {exact} (scale {mag})"
                            );
                        }
                        assert!(
                            (got[r] - twin[r]).abs() as f64 <= 1e-6 * mag,
                            "{what} row {r}: {} vs twin {}",
                            got[r],
                            twin[r]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn every_rows_batch_kernel_is_the_row_kernel_per_token() {
    // Rows: R-ths of 9 (R = 2 or 4) and a tail, or only a tail (3); tokens: one pass of each
    // width (1..=4) and passes of 4 + a tail (up to 9, so B = 2, 3, 4, 8 are each one call);
    // K: whole chunks, a partial last chunk, rows of fewer groups than a chunk, and odd block
    // counts (the kernels' K tails: 320 / 640 are 5 blocks of 64 / 128 elements, 96 is 3 of 32).
    let shapes = [
        (32, 512),
        (64, 2048),
        (128, 1536),
        (64, 4096 + 512),
        (256, 512),
        (64, 640),
        (32, 320),
        (32, 96),
    ];
    for (dot, np) in Dot::all_available().into_iter().flat_map(|d| MODES.map(|n| (d, n))) {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for ((group, cols), n) in shapes.into_iter().flat_map(|s| [(s, 37), (s, 3)]) {
                if cols % (2 * dot.block()) != 0 {
                    continue;
                }
                let what = format!("{dot:?} {np} planes {dtype:?} group {group} cols {cols} rows {n}");
                let (g_n, g_pad) = (cols / group, (cols / group).next_multiple_of(CHUNK_GROUPS));
                let m = Packed::new(n, cols, group, dtype, 13 + cols as u64);
                let rows = m.rows();
                let toks = 9;
                let xs: Vec<Vec<f32>> = (0..toks)
                    .map(|t| activations(cols, 100 * t as u64 + cols as u64))
                    .collect();
                let mut dx = vec![0f32; toks * g_pad];
                let mut gsum = vec![0f32; toks * g_pad];
                let mut xq = vec![0i8; toks * np * cols];
                for (t, x) in xs.iter().enumerate() {
                    let (d, q) = (&mut dx[t * g_pad..][..g_n], &mut xq[t * np * cols..][..np * cols]);
                    int8::quantize(Isa::get(), dot, np, x, group, d, q);
                    for (g, xg) in x.chunks_exact(group).enumerate() {
                        gsum[t * g_pad + g] = xg.iter().sum();
                    }
                }
                let planes: Vec<Planes> = (0..toks)
                    .map(|t| Planes {
                        dot,
                        n: np,
                        dx: &dx[t * g_pad..][..g_pad],
                        gsum: &gsum[t * g_pad..][..g_pad],
                        xq: &xq[t * np * cols..][..np * cols],
                    })
                    .collect();
                let mut alone = vec![0f32; toks * n];
                for (t, x) in planes.iter().enumerate() {
                    int8::rows(&rows, x, &mut alone[t * n..][..n]);
                }
                for tn in [1, 2, 3, 4, 5, 8, 9] {
                    // Outputs at a stride past n: the gaps must stay untouched.
                    let stride = n + 3;
                    let mut got = vec![f32::NAN; tn * stride];
                    int8::rows_batch(&rows, &planes[..tn], n, &mut got, stride);
                    for t in 0..tn {
                        for r in 0..n {
                            assert_eq!(
                                got[t * stride + r].to_bits(),
                                alone[t * n + r].to_bits(),
                                "{what}, {tn} tokens: token {t} row {r}: {} vs the row kernel's {}",
                                got[t * stride + r],
                                alone[t * n + r]
                            );
                        }
                        if t + 1 < tn {
                            assert!(
                                got[t * stride + n..][..3].iter().all(|v| v.is_nan()),
                                "{what}: gap written"
                            );
                        }
                    }
                }
                // And against the exact affine product (f64), within x's rounding, for the last token.
                let t = toks - 1;
                let mut got = vec![0f32; toks * n];
                int8::rows_batch(&rows, &planes, n, &mut got, n);
                for r in 0..n {
                    let (exact, mag, rounding) = m.exact(r, &xs[t], &dx[t * g_pad..], np);
                    let v = got[t * n + r] as f64;
                    assert!(
                        (v - exact).abs() <= 2e-6 * mag + rounding,
                        "{what} row {r}: {v} vs exact {exact} (scale {mag})"
                    );
                }
            }
        }
    }
}

#[test]
fn fused_rows_cover_the_mlx_shapes_on_x86_and_arm64() {
    for dot in Dot::all_available() {
        let fused = dot != Dot::Portable;
        for group in [32, 64, 128] {
            assert_eq!(dot.fused_rows(group, DType::BF16), fused, "{dot:?} group {group}");
        }
        assert!(!dot.fused_rows(256, DType::BF16));
    }
}

#[test]
fn half_step_residuals_carry_into_the_plane_before() {
    // d = 1 (the group's max is 127); values whose residuals sit exactly half a step up, at
    // plane 0 (k + 1/2) and at plane 1 (k + 127.5/256: plane 1 rounds to 128 and must carry).
    let specials = [
        3.5,
        -2.5,
        0.5,
        7.0 + 127.5 / 256.0,
        -(7.0 + 127.5 / 256.0),
        10.0 + 0.5 / 256.0,
    ];
    for dot in Dot::all_available() {
        let b = dot.block();
        let cols = 2 * b.max(64);
        let mut x = vec![0f32; cols];
        x[0] = 127.0;
        x[1..1 + specials.len()].copy_from_slice(&specials);
        let (mut dx, mut xq) = (vec![0f32; cols / 64], vec![0i8; PLANES * cols]);
        int8::quantize(Isa::get(), dot, PLANES, &x, 64, &mut dx, &mut xq);
        assert_eq!(dx[0], 1.0);
        for (i, &v) in x.iter().enumerate().take(64) {
            // Every value here is exact in three planes of 256x steps.
            assert_eq!(rebuilt(dot, PLANES, cols, &xq, &dx, 64, i), v, "{dot:?} element {i}");
        }
        assert!(xq.contains(&-128), "{dot:?}: no carry taken");
    }
}
