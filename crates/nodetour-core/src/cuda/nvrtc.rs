//! NVRTC, loaded at run time: CUDA C compiled to CUBIN for the GPU at hand (no PTX JIT at load).

use std::ffi::{CString, c_char};

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// NVRTC's version, or `Unsupported` where libnvrtc cannot be loaded.
pub fn version() -> Result<(i32, i32)> {
    if !super::libs::nvrtc_present() {
        return Err(Error::Unsupported {
            what: "NVRTC",
            reason:
                "libnvrtc.so is not loadable (install the CUDA runtime compiler, e.g. cuda-nvrtc)"
                    .into(),
        });
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; out-pointers are valid.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion", "")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, what: &str, arch: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::CompileKernels {
            arch: arch.to_owned(),
            log: format!("{what}: {r:?}"),
        })
    }
}

/// Compiles `source` (named `name` in messages) to a CUBIN for compute capability `arch`
/// (`(9, 0)` → `sm_90`), with extra NVRTC `options`.
pub fn compile_cubin(
    source: &str,
    name: &str,
    arch: (i32, i32),
    options: &[&str],
) -> Result<Vec<u8>> {
    version()?;
    let sm = format!("sm_{}{}", arch.0, arch.1);
    let bad = |log: String| Error::CompileKernels {
        arch: sm.clone(),
        log,
    };
    let src = CString::new(source).map_err(|_| bad("the source contains a NUL byte".into()))?;
    let cname = CString::new(name).map_err(|_| bad("the name contains a NUL byte".into()))?;
    let mut opts: Vec<CString> =
        vec![CString::new(format!("--gpu-architecture={sm}")).expect("no NUL")];
    for o in options {
        opts.push(CString::new(*o).map_err(|_| bad(format!("option {o:?} contains a NUL byte")))?);
    }
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    check(
        // SAFETY: valid C strings; no headers.
        unsafe {
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
        &sm,
    )?;
    let result = (|| {
        // SAFETY: prog is live; opt_ptrs holds opts.len() valid C strings.
        let compiled =
            unsafe { sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
        if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(bad(format!("{compiled:?}: {}", program_log(prog))));
        }
        let mut size = 0usize;
        check(
            // SAFETY: prog is compiled; size is a valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) },
            "nvrtcGetCUBINSize",
            &sm,
        )?;
        let mut cubin = vec![0u8; size];
        check(
            // SAFETY: cubin has room for size bytes.
            unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) },
            "nvrtcGetCUBIN",
            &sm,
        )?;
        Ok(cubin)
    })();
    // SAFETY: prog is live and destroyed once.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    result
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: prog is live.
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut log = vec![0u8; size];
    // SAFETY: log has room for size bytes.
    unsafe { sys::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast()) };
    String::from_utf8_lossy(&log)
        .trim_end_matches('\0')
        .trim()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_nvrtc_compilation_is_unsupported() {
        if version().is_ok() {
            println!("SKIP this machine has NVRTC");
            return;
        }
        assert!(matches!(
            compile_cubin("", "x", (9, 0), &[]),
            Err(Error::Unsupported { what: "NVRTC", .. })
        ));
    }
}
