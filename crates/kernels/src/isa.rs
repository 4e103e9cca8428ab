//! Which instruction set the CPU kernels use, chosen at run time.
//!
//! Nothing is assumed about the build machine: the binary is compiled for the baseline target and
//! every SIMD kernel is a `#[target_feature]` function that runs only after
//! [`Isa::is_supported`] has said yes for this CPU. [`Isa::active`] is the process-wide choice: the
//! best the CPU supports, or the one named by the `MEMFIT_ISA` environment variable (`avx512`,
//! `avx2`, `portable`) so tests and users can force a slower path. Tests of every kernel run each
//! supported path against [`Isa::Portable`].

use std::fmt;
use std::sync::OnceLock;

/// The environment variable that overrides the detected instruction set.
pub const ISA_ENV: &str = "MEMFIT_ISA";

/// An instruction-set level the kernels have a path for, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F (x86-64): 16 f32 lanes.
    Avx512,
    /// AVX2 with FMA (x86-64): 8 f32 lanes.
    Avx2Fma,
    /// Plain Rust for the baseline target (any CPU).
    Portable,
}

impl Isa {
    /// Every level, best first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2Fma, Isa::Portable];

    /// The name used by `MEMFIT_ISA` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Parses a name as [`Isa::name`] prints it.
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run the level's kernels.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The levels this CPU supports, best first (always ends with [`Isa::Portable`]).
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.is_supported()).collect()
    }

    /// The best level this CPU supports.
    pub fn detected() -> Isa {
        Isa::supported()[0]
    }

    /// What `MEMFIT_ISA` asks for: `Ok(None)` when it is unset, an error naming the problem when it
    /// names no level or one this CPU cannot run. The CLI checks this at start-up.
    pub fn from_env() -> Result<Option<Isa>, String> {
        let Ok(value) = std::env::var(ISA_ENV) else { return Ok(None) };
        let names = Isa::ALL.map(Isa::name).join(", ");
        let isa = Isa::parse(&value).ok_or_else(|| format!("{ISA_ENV}={value:?} is not one of {names}"))?;
        if !isa.is_supported() {
            let ok = Isa::supported().into_iter().map(Isa::name).collect::<Vec<_>>().join(", ");
            return Err(format!("{ISA_ENV}={value:?}: this CPU cannot run {} kernels (it supports {ok})", isa.name()));
        }
        Ok(Some(isa))
    }

    /// The process-wide level: `MEMFIT_ISA` when it names a supported level, else the detected one.
    /// Chosen once, on first use.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| Isa::from_env().ok().flatten().unwrap_or_else(Isa::detected))
    }
}

/// Defines a function compiled once per instruction set, for the plain loops of the cpu backend
/// (layer-norm rows, softmax rows) that have no hand-written path: the body is written once, as
/// ordinary Rust, and the compiler auto-vectorises a copy of it per level (`#[target_feature]`
/// functions that inline it). The defined function takes an [`Isa`] first and runs that level's copy
/// (the portable one on a CPU that lacks the level).
///
/// The copies compute the same bits: Rust never fuses a separate multiply and add into one
/// instruction, nor reorders float operations, so a wider register changes how many elements one
/// instruction handles, not what is computed (the tests run each supported level against the
/// portable one). The body's helpers must be `#[inline(always)]` to be compiled into each copy.
///
/// ```
/// memfit_kernels::multiversion! {
///     /// `y = a x + y`.
///     pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
///         for (y, x) in y.iter_mut().zip(x) {
///             *y += a * *x;
///         }
///     }
/// }
/// let mut y = [1.0, 2.0];
/// axpy(memfit_kernels::Isa::active(), 2.0, &[1.0, 1.0], &mut y);
/// assert_eq!(y, [3.0, 4.0]);
/// ```
#[macro_export]
macro_rules! multiversion {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$($g:ident : $bound:path),+>)? ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        #[inline]
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($g: $bound),+>)? (isa: $crate::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// The CPU must support AVX-512F.
                #[target_feature(enable = "avx512f")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512 $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                /// # Safety
                /// The CPU must support AVX2 and FMA.
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2 $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match isa {
                    // SAFETY: this CPU supports the level (checked in the guard).
                    $crate::Isa::Avx512 if isa.is_supported() => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::Isa::Avx2Fma if isa.is_supported() => return unsafe { avx2($($arg),*) },
                    _ => {}
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            body($($arg),*)
        }
    };
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_portable_is_always_there() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
        assert_eq!(Isa::parse(" AVX2 "), Some(Isa::Avx2Fma));
        assert_eq!(Isa::parse("sse"), None);
        assert_eq!(Isa::supported().last(), Some(&Isa::Portable));
        assert!(Isa::detected().is_supported());
        assert!(Isa::active().is_supported());
    }
}
