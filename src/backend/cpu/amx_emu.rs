//! AMX-INT8 tiles in software: runs the very instruction text of
//! `qgemm_amx`'s `asm!` blocks on CPUs without AMX, so the `amx` kernel
//! level (its layouts, strides, tile shapes and drivers) is tested on every
//! machine with AVX-512 VNNI, not only on the few with AMX.
//!
//! # Idea
//! Each AMX block of `qgemm_amx` is written once, as a template, and goes
//! either to `asm!` (hardware) or to [`run`], which parses the same lines
//! and executes them against a per-thread model of the 8 tile registers
//! and their configuration. What is emulated, from the instruction set
//! reference:
//! - `ldtilecfg` (through [`configure`]): palette 1, each tile's rows and
//!   bytes per row;
//! - `tilezero tmmN`;
//! - `tileloadd tmmN, [base + index*1 + disp]`: `rows` rows of `colsb`
//!   bytes, row r at `base + disp + r·index`; the rest of the tile zeroed;
//! - `tilestored [base + index*1 + disp], tmmN`: the same rows back;
//! - `tdpb{ss,su,us,uu}d tmmC, tmmA, tmmB`: for row m of C and dword n,
//!   `C[m][n] += Σ_k Σ_{i<4} A[m][4k+i] · B[k][4n+i]`, wrapping i32 sums,
//!   the first letter the signedness of A's bytes, the second of B's; the
//!   shape checks the hardware faults on (`#UD`) are assertions here.
//!
//! Nothing else is accepted: an instruction this module does not know is
//! a panic, so a kernel cannot pass its tests by an op the emulator skips.
//!
//! # Parameters
//! The process runs emulated tiles when `KVRUN_AMX_EMULATE=1` is set
//! (checked by `isa::check_env`) or after `isa::emulate_amx` (the tests),
//! on CPUs with AVX-512 VNNI (the rest of the `amx` level is VNNI code).
//! It is slow (a scalar loop per product), meant for tests and for
//! checking a machine's AMX results against it, not for running models.

use std::cell::RefCell;

/// Tiles of the emulated register file.
const TILES: usize = 8;
/// A tile's most rows and most bytes per row (palette 1).
const MAX_ROWS: usize = 16;
const MAX_COLSB: usize = 64;

/// One thread's tile state: the configuration (palette 0: none) and the
/// 8 tiles of 16 rows × 64 bytes.
struct State {
    cfg: [u8; 64],
    data: [[[u8; MAX_COLSB]; MAX_ROWS]; TILES],
}

thread_local! {
    static STATE: RefCell<State> = const {
        RefCell::new(State {
            cfg: [0; 64],
            data: [[[0; MAX_COLSB]; MAX_ROWS]; TILES],
        })
    };
}

/// Loads a 64-byte tile configuration (`ldtilecfg`) on this thread and
/// returns the previous one (`sttilecfg`: all zeros when there was none).
/// A configuration of palette 0 releases the tiles (`tilerelease`). Every
/// tile is zeroed, as the hardware does on a load of the configuration.
/// Panics on a palette other than 0 or 1, or a shape over 16 × 64.
pub fn configure(cfg: [u8; 64]) -> [u8; 64] {
    assert!(cfg[0] <= 1, "amx emulator: palette {} unsupported", cfg[0]);
    if cfg[0] == 1 {
        for t in 0..TILES {
            let (rows, colsb) = shape_of(&cfg, t);
            assert!(
                rows <= MAX_ROWS && colsb <= MAX_COLSB,
                "amx emulator: tmm{t} configured {rows} × {colsb}"
            );
        }
    }
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let prev = if s.cfg[0] == 0 { [0; 64] } else { s.cfg };
        s.cfg = if cfg[0] == 0 { [0; 64] } else { cfg };
        s.data = [[[0; MAX_COLSB]; MAX_ROWS]; TILES];
        prev
    })
}

/// (rows, bytes per row) of tile `t` in configuration `cfg`.
fn shape_of(cfg: &[u8; 64], t: usize) -> (usize, usize) {
    let colsb = u16::from_le_bytes([cfg[16 + 2 * t], cfg[17 + 2 * t]]) as usize;
    (cfg[48 + t] as usize, colsb)
}

/// Runs the AMX instructions of `text` (one per line, `asm!` template
/// syntax: `{name}` an operand of `args`) on this thread's emulated tiles.
///
/// # Safety
/// What the hardware instructions would need: every tile load reads, and
/// every tile store writes, `rows` rows of `colsb` bytes at the addresses
/// the operands give.
pub unsafe fn run(text: &str, args: &[(&str, usize)]) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        assert!(s.cfg[0] == 1, "amx emulator: tiles used unconfigured");
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let (op, rest) = line.split_once(' ').unwrap_or((line, ""));
            let ops: Vec<&str> = split_operands(rest);
            match (op, ops.as_slice()) {
                ("tilezero", [t]) => {
                    let t = tile(t);
                    s.data[t] = [[0; MAX_COLSB]; MAX_ROWS];
                }
                ("tileloadd" | "tileloaddt1", [t, m]) => {
                    let t = tile(t);
                    let (base, stride) = address(m, args);
                    let (rows, colsb) = shape_of(&s.cfg, t);
                    s.data[t] = [[0; MAX_COLSB]; MAX_ROWS];
                    for r in 0..rows {
                        let at = base.wrapping_add(r.wrapping_mul(stride));
                        // SAFETY: the caller's contract (row r of the tile
                        // lies at `at`, colsb bytes).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                at as *const u8,
                                s.data[t][r].as_mut_ptr(),
                                colsb,
                            )
                        };
                    }
                }
                ("tilestored", [m, t]) => {
                    let t = tile(t);
                    let (base, stride) = address(m, args);
                    let (rows, colsb) = shape_of(&s.cfg, t);
                    for r in 0..rows {
                        let at = base.wrapping_add(r.wrapping_mul(stride));
                        // SAFETY: the caller's contract (row r of the
                        // destination lies at `at`, colsb bytes).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                s.data[t][r].as_ptr(),
                                at as *mut u8,
                                colsb,
                            )
                        };
                    }
                }
                ("tdpbssd" | "tdpbsud" | "tdpbusd" | "tdpbuud", [c, a, b]) => {
                    // tdpb<A><B>d: s signed bytes, u unsigned
                    let (a_signed, b_signed) = (op.as_bytes()[4] == b's', op.as_bytes()[5] == b's');
                    let s = &mut *s;
                    dot(s, (tile(c), tile(a), tile(b)), a_signed, b_signed);
                }
                _ => panic!("amx emulator: unknown instruction `{line}`"),
            }
        }
    })
}

/// `tdpb..d C, A, B` on the state, with the hardware's shape checks.
fn dot(s: &mut State, (c, a, b): (usize, usize, usize), a_signed: bool, b_signed: bool) {
    assert!(
        c != a && c != b && a != b,
        "amx emulator: tdpb with repeated tiles"
    );
    let (c_rows, c_colsb) = shape_of(&s.cfg, c);
    let (a_rows, a_colsb) = shape_of(&s.cfg, a);
    let (b_rows, b_colsb) = shape_of(&s.cfg, b);
    let k_dwords = a_colsb / 4;
    assert!(
        a_rows == c_rows && b_colsb == c_colsb && k_dwords == b_rows && a_colsb % 4 == 0,
        "amx emulator: shapes C {c_rows}×{c_colsb}, A {a_rows}×{a_colsb}, B {b_rows}×{b_colsb} do not multiply"
    );
    let byte = |x: u8, signed: bool| if signed { x as i8 as i32 } else { x as i32 };
    for m in 0..c_rows {
        for n in 0..c_colsb / 4 {
            let mut acc = i32::from_le_bytes(s.data[c][m][4 * n..4 * n + 4].try_into().unwrap());
            for k in 0..k_dwords {
                for i in 0..4 {
                    let x = byte(s.data[a][m][4 * k + i], a_signed);
                    let y = byte(s.data[b][k][4 * n + i], b_signed);
                    acc = acc.wrapping_add(x * y);
                }
            }
            s.data[c][m][4 * n..4 * n + 4].copy_from_slice(&acc.to_le_bytes());
        }
        // the bytes past colsb of a destination row are zeroed
        s.data[c][m][c_colsb..].fill(0);
    }
    for row in s.data[c][c_rows..].iter_mut() {
        row.fill(0);
    }
}

/// The operands of an instruction: split at the commas outside brackets.
fn split_operands(rest: &str) -> Vec<&str> {
    let (mut out, mut depth, mut from) = (Vec::new(), 0, 0);
    for (i, ch) in rest.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(rest[from..i].trim());
                from = i + 1;
            }
            _ => {}
        }
    }
    if !rest[from..].trim().is_empty() {
        out.push(rest[from..].trim());
    }
    out
}

/// `tmmN` → N.
fn tile(t: &str) -> usize {
    match t.strip_prefix("tmm").and_then(|n| n.parse::<usize>().ok()) {
        Some(n) if n < TILES => n,
        _ => panic!("amx emulator: `{t}` is not a tile register"),
    }
}

/// `[{base} + {index}*1 + disp + ...]` → (base + Σ disp, index): the
/// address of row 0 and the stride between rows.
fn address(m: &str, args: &[(&str, usize)]) -> (usize, usize) {
    let inner = m
        .strip_prefix('[')
        .and_then(|m| m.strip_suffix(']'))
        .unwrap_or_else(|| panic!("amx emulator: `{m}` is not a memory operand"));
    let value = |name: &str| {
        let name = name
            .strip_prefix('{')
            .and_then(|n| n.strip_suffix('}'))
            .unwrap_or_else(|| panic!("amx emulator: `{name}` is not an operand"));
        args.iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("amx emulator: no operand `{name}`"))
            .1
    };
    let (mut base, mut stride, mut disp) = (None, None, 0usize);
    for term in inner.split('+').map(str::trim) {
        if let Some(reg) = term.strip_suffix("*1") {
            assert!(
                stride.is_none(),
                "amx emulator: two index registers in `{m}`"
            );
            stride = Some(value(reg));
        } else if term.starts_with('{') {
            assert!(base.is_none(), "amx emulator: two base registers in `{m}`");
            base = Some(value(term));
        } else {
            let d: usize = term
                .parse()
                .unwrap_or_else(|_| panic!("amx emulator: bad displacement `{term}` in `{m}`"));
            disp += d;
        }
    }
    let base = base.unwrap_or_else(|| panic!("amx emulator: no base register in `{m}`"));
    // a tile memory operand without an index register has stride 0
    (base.wrapping_add(disp), stride.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(shape: [(u8, u16); 8]) -> [u8; 64] {
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, (rows, bytes)) in shape.into_iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            c[48 + t] = rows;
        }
        c
    }

    /// Each of the four signedness variants against the formula, on a
    /// ragged shape (C 5 × 12 bytes, A 5 × 24, B 6 × 12), loads at a
    /// stride and a displacement, and the accumulation into C's old value.
    #[test]
    fn products_follow_the_reference_formula() {
        let mut r = crate::rng::Rng::new(7);
        let (m_rows, k, n) = (5usize, 6usize, 3usize);
        let prev = configure(cfg([
            (m_rows as u8, 4 * n as u16),
            (m_rows as u8, 4 * k as u16),
            (k as u8, 4 * n as u16),
            (16, 64),
            (16, 64),
            (16, 64),
            (16, 64),
            (16, 64),
        ]));
        assert_eq!(prev[0], 0);
        let stride = 40usize;
        let a: Vec<u8> = (0..m_rows * stride + 8)
            .map(|_| r.next_u64() as u8)
            .collect();
        let b: Vec<u8> = (0..k * stride + 8).map(|_| r.next_u64() as u8).collect();
        let c0: Vec<i32> = (0..m_rows * n).map(|_| r.next_u64() as i32 >> 8).collect();
        for op in ["tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud"] {
            let (sa, sb) = (op.as_bytes()[4] == b's', op.as_bytes()[5] == b's');
            let mut out = c0.clone();
            let text = format!(
                "tileloadd tmm0, [{{c}} + {{cs}}*1]\n\
                 tileloadd tmm1, [{{a}} + {{s}}*1 + 8]\n\
                 tileloadd tmm2, [{{b}} + {{s}}*1 + 4 + 4]\n\
                 {op} tmm0, tmm1, tmm2\n\
                 tilestored [{{c}} + {{cs}}*1], tmm0"
            );
            let args = [
                ("a", a.as_ptr() as usize),
                ("b", b.as_ptr() as usize),
                ("c", out.as_mut_ptr() as usize),
                ("s", stride),
                ("cs", 4 * n),
            ];
            // SAFETY: every row read or written lies inside a, b and out.
            unsafe { run(&text, &args) };
            let v = |x: u8, s: bool| if s { x as i8 as i32 } else { x as i32 };
            for m in 0..m_rows {
                for j in 0..n {
                    let mut want = c0[m * n + j];
                    for kk in 0..k {
                        for i in 0..4 {
                            let x = v(a[8 + m * stride + 4 * kk + i], sa);
                            let y = v(b[8 + kk * stride + 4 * j + i], sb);
                            want = want.wrapping_add(x * y);
                        }
                    }
                    assert_eq!(out[m * n + j], want, "{op} ({m}, {j})");
                }
            }
        }
        assert_eq!(configure([0; 64])[0], 1);
    }

    /// What the hardware faults on is a panic here, not a silent result.
    #[test]
    fn misuse_panics() {
        let ok = |text: &'static str, shape: [(u8, u16); 8]| {
            std::thread::spawn(move || {
                configure(cfg(shape));
                let buf = [0u8; 1024];
                // SAFETY: every load reads at most 16 × 64 bytes of buf.
                unsafe { run(text, &[("p", buf.as_ptr() as usize), ("s", 64)]) }
            })
            .join()
            .is_ok()
        };
        let full = [(16, 64); 8];
        assert!(ok(
            "tileloadd tmm1, [{p} + {s}*1]\ntdpbusd tmm0, tmm1, tmm2",
            full
        ));
        // A's bytes per row (K) do not match B's rows
        let mut bad = full;
        bad[2] = (8, 64);
        assert!(!ok("tdpbusd tmm0, tmm1, tmm2", bad));
        assert!(!ok("tdpbusd tmm0, tmm0, tmm2", full));
        assert!(!ok("tdpbf16ps tmm0, tmm1, tmm2", full));
        assert!(!ok("tileloadd tmm8, [{p} + {s}*1]", full));
        assert!(!ok("tileloadd tmm1, [{q} + {s}*1]", full));
        // unconfigured tiles
        assert!(!std::thread::spawn(|| unsafe { run("tilezero tmm0", &[]) })
            .join()
            .is_ok());
    }
}
