//! Opening a device: typed errors, never a panic. Meaningful on both kinds of machine: without a
//! driver they assert the "no driver" error; with one, that the device opens and reports itself,
//! that a huge ordinal is "no such device" and that an impossible allocation is "out of memory".

use tandem_kernels_cuda::{
    CudaDevice, CudaError, CudaLib, MIN_COMPUTE_CAPABILITY, device_count, libs,
};

fn driver_present() -> bool {
    libs::is_present(CudaLib::Driver)
}

#[test]
fn open_0_reports_the_device_or_the_missing_driver() {
    match CudaDevice::open(0) {
        Ok(dev) => {
            assert!(driver_present());
            assert!(!dev.name().is_empty());
            assert!(
                dev.compute_capability() >= MIN_COMPUTE_CAPABILITY,
                "{:?}",
                dev.compute_capability()
            );
            assert!(dev.total_bytes() > 0 && dev.free_bytes_at_open() <= dev.total_bytes());
            assert_eq!(dev.ordinal(), 0);
        }
        Err(CudaError::NoDriver { library, names, .. }) => {
            assert!(!driver_present());
            assert_eq!(library, "libcuda.so.1");
            assert!(names.iter().any(|n| n == "libcuda.so.1"), "{names:?}");
            let msg = CudaDevice::open(0).unwrap_err().to_string();
            assert!(
                msg.starts_with("no CUDA driver: libcuda.so.1 not found"),
                "{msg}"
            );
            assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
        }
        Err(CudaError::NoSuchDevice {
            ordinal: 0,
            count: 0,
        }) => assert!(driver_present(), "a driver without GPUs"),
        Err(e) => panic!("unexpected error opening cuda:0: {e}"),
    }
}

#[test]
fn a_huge_ordinal_is_no_such_device() {
    match CudaDevice::open(1000) {
        Err(CudaError::NoSuchDevice { ordinal, count }) => {
            assert_eq!(ordinal, 1000);
            assert_eq!(count, device_count().unwrap());
        }
        Err(CudaError::NoDriver { .. }) => assert!(!driver_present()),
        other => panic!("expected NoSuchDevice or NoDriver, got {other:?}"),
    }
}

#[test]
fn an_allocation_larger_than_the_device_is_out_of_memory() {
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(CudaError::NoDriver { .. } | CudaError::NoSuchDevice { .. }) => return,
        Err(e) => panic!("{e}"),
    };
    let asked = dev.total_bytes() + (1 << 30);
    match dev.alloc_zeros::<u8>(asked as usize) {
        Err(CudaError::OutOfMemory {
            ordinal: 0,
            asked_bytes,
            free_bytes,
        }) => {
            assert_eq!(asked_bytes, asked);
            assert!(free_bytes <= dev.total_bytes());
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Small allocations still work afterwards.
    let b = dev.alloc_zeros::<f32>(1024).unwrap();
    assert_eq!(dev.download(&b).unwrap(), vec![0.0f32; 1024]);
}

#[test]
fn missing_libraries_are_typed_errors_that_name_what_was_tried() {
    for lib in [
        CudaLib::Driver,
        CudaLib::Nvrtc,
        CudaLib::Cublas,
        CudaLib::Nccl,
    ] {
        match libs::require(lib) {
            Ok(()) => assert!(libs::is_present(lib)),
            Err(CudaError::NoDriver { names, .. }) => {
                assert_eq!(lib, CudaLib::Driver);
                assert_eq!(names, libs::candidates(lib));
            }
            Err(CudaError::LibraryMissing { lib: l, names, .. }) => {
                assert_eq!(l, lib);
                assert_eq!(names, libs::candidates(lib));
            }
            Err(e) => panic!("{lib}: {e}"),
        }
    }
    // NVRTC must be there: scripts/test.sh puts the pinned wheel on the loader's path.
    libs::require(CudaLib::Nvrtc).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn error_messages_carry_the_numbers() {
    let e = CudaError::OutOfMemory {
        ordinal: 1,
        asked_bytes: 2048,
        free_bytes: 1024,
    };
    assert_eq!(
        e.to_string(),
        "out of device memory on CUDA device 1: asked 2048 bytes, 1024 free"
    );
    assert_eq!(e.error_type(), "out_of_memory");
    let e = CudaError::UnsupportedArch {
        ordinal: 0,
        name: "Tesla T4".into(),
        cc: (7, 5),
        min: MIN_COMPUTE_CAPABILITY,
    };
    assert_eq!(
        e.to_string(),
        "CUDA device 0 (Tesla T4) has compute capability 7.5; tandem needs 8.0 or newer"
    );
    let e = CudaError::NoSuchDevice {
        ordinal: 3,
        count: 1,
    };
    assert_eq!(
        e.to_string(),
        "no CUDA device 3: this machine has 1 device(s)"
    );
}
