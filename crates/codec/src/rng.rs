//! The workspace's one pseudo-random generator, SplitMix64 (Steele, Lea and Flood, 2014): seeds and
//! hashes ([`splitmix64`]), the lossy encoder's row sampling, the sampler's draws, synthetic
//! weights, and every test's and benchmark's random inputs. Small, seedable, and the same stream
//! on every machine.

/// The golden-ratio increment of the generator's state (also a multiplier that spreads small
/// integers over 64 bits).
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output for state `z`: the state advanced once and mixed. A good 64-bit hash of
/// `z`, and the first output of [`SplitMix64::new(z)`](SplitMix64::new).
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 stream.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        let r = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GAMMA);
        r
    }
    /// Uniform in [0, 1), 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in 0..n (`n` > 0; the modulo bias is below 2^-32 for n < 2^32).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Standard normal (Box–Muller, one value per two uniforms).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published SplitMix64 outputs for seed 1234567 (the reference C implementation).
    #[test]
    fn matches_the_reference_stream() {
        let mut r = SplitMix64::new(1234567);
        let got: Vec<u64> = (0..5).map(|_| r.next_u64()).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
        assert_eq!(splitmix64(1234567), got[0]);
    }

    #[test]
    fn unit_below_and_normal_are_in_range() {
        let mut r = SplitMix64::new(7);
        let n = 20_000;
        let (mut sum, mut sq) = (0.0, 0.0);
        for _ in 0..n {
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(r.below(10) < 10);
            let z = r.normal();
            sum += z;
            sq += z * z;
        }
        let mean = sum / n as f64;
        let var = sq / n as f64 - mean * mean;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
    }
}
