//! Deterministic random streams (splitmix64 keyed by the seed and each tensor's name, one
//! stream per chunk) and the MXFP4 quantisation rule of docs/model.md#mxfp4-experts.

/// splitmix64 finaliser.
pub(super) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A splitmix64 generator.
#[derive(Clone, Debug)]
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Two approximately standard normal draws from one 64-bit output: each is the sum of four
    /// 8-bit uniforms, centred and scaled to unit variance (Irwin–Hall with n = 4; bounded at
    /// ±3.46, steps of 0.0068). Pure integer and float arithmetic: the same on every platform.
    #[inline]
    pub(super) fn normal2(&mut self) -> [f32; 2] {
        const M: u64 = 0x00ff_00ff_00ff_00ff;
        let r = self.next_u64();
        // Four 16-bit lanes of byte-pair sums, then two 32-bit lanes of four-byte sums.
        let p = (r & M) + ((r >> 8) & M);
        let q = (p & 0x0000_ffff_0000_ffff) + ((p >> 16) & 0x0000_ffff_0000_ffff);
        // Each uniform is (x + 0.5) / 256, so a sum is (s + 2) / 256 with mean 2, variance 1/3.
        let z = |s: u64| ((s as f32 + 2.0) * (1.0 / 256.0) - 2.0) * 1.732_050_8;
        [z(q & 0xffff_ffff), z(q >> 32)]
    }

    /// Uniform in 0..n (n > 0; the modulo bias is irrelevant here).
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// FNV-1a over a name.
pub(super) fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The stream key of a tensor (or MXFP4 matrix) under a seed.
pub(super) fn tensor_key(seed: u64, name: &str) -> u64 {
    mix64(mix64(seed ^ 0x6b33_5f73_796e_7468) ^ fnv1a(name))
}

/// The generator of chunk `k` of a tensor.
pub(super) fn chunk_rng(key: u64, k: usize) -> Rng {
    Rng(mix64(
        key ^ (k as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
    ))
}

// ------------------------------------------------------------------------------------ MXFP4

/// Quantise one group of 32 values with the rule of docs/model.md#mxfp4-experts; writes 16 packed bytes
/// (low nibble = even element) and returns the scale byte.
pub fn quantise_group(w: &[f32; 32], packed: &mut [u8]) -> u8 {
    let max = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    // floor(log2(max)) of a normal float is its unbiased exponent.
    let e = if max > 0.0 {
        ((max.to_bits() >> 23) & 0xff) as i32 - 127 - 2
    } else {
        0
    };
    let e = e.clamp(-126, 127);
    // 1/2^e exactly (1 ≤ 127 − e ≤ 253).
    let inv = f32::from_bits(((127 - e) as u32) << 23);
    let code = |x: f32| -> u8 {
        let a = x.abs() * inv;
        // Nearest E2M1 magnitude, ties to the smaller code; above 6 saturates to 6 (code 7).
        let m = u8::from(a > 0.25)
            + u8::from(a > 0.75)
            + u8::from(a > 1.25)
            + u8::from(a > 1.75)
            + u8::from(a > 2.5)
            + u8::from(a > 3.5)
            + u8::from(a > 5.0);
        m | if x < 0.0 { 8 } else { 0 }
    };
    for (j, byte) in packed.iter_mut().take(16).enumerate() {
        *byte = code(w[2 * j]) | (code(w[2 * j + 1]) << 4);
    }
    (e + 127) as u8
}
