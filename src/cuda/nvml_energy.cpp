// EnergyCounter: NVML's total-energy counter through dlopen, so twell has no link-time dependency on
// the driver's management library. Only the four entry points used are declared, with NVML's ABI.
#include <dlfcn.h>

#include <cmath>
#include <string>

#include <cuda_runtime.h>

#include "twell/model_cuda.h"

namespace twell::cuda {
namespace {

using NvmlReturn = int;  // nvmlReturn_t: 0 is NVML_SUCCESS
using NvmlDevice = void*;
using InitFn = NvmlReturn (*)();
using ShutdownFn = NvmlReturn (*)();
using HandleByBusIdFn = NvmlReturn (*)(const char*, NvmlDevice*);
using EnergyFn = NvmlReturn (*)(NvmlDevice, unsigned long long*);

}  // namespace

struct EnergyCounter::Impl {
  void* library = nullptr;
  ShutdownFn shutdown = nullptr;
  EnergyFn energy = nullptr;
  NvmlDevice device = nullptr;
  std::string why;

  Impl() {
    library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      why = "libnvidia-ml.so.1 not found";
      return;
    }
    auto init = reinterpret_cast<InitFn>(dlsym(library, "nvmlInit_v2"));
    shutdown = reinterpret_cast<ShutdownFn>(dlsym(library, "nvmlShutdown"));
    auto by_bus_id = reinterpret_cast<HandleByBusIdFn>(dlsym(library, "nvmlDeviceGetHandleByPciBusId_v2"));
    energy = reinterpret_cast<EnergyFn>(dlsym(library, "nvmlDeviceGetTotalEnergyConsumption"));
    if (!init || !shutdown || !by_bus_id || !energy) {
      why = "libnvidia-ml.so.1 lacks the NVML energy functions";
      close();
      return;
    }
    if (init() != 0) {
      why = "nvmlInit failed";
      shutdown = nullptr;
      close();
      return;
    }
    // The CUDA device this process runs on, found by PCI bus id (NVML and CUDA number devices differently).
    int cuda_device = 0;
    char bus_id[64] = {};
    if (cudaGetDevice(&cuda_device) != cudaSuccess || cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, cuda_device) != cudaSuccess ||
        by_bus_id(bus_id, &device) != 0) {
      cudaGetLastError();
      why = "NVML does not know the CUDA device";
      close();
      return;
    }
    unsigned long long millijoules = 0;
    if (energy(device, &millijoules) != 0) {
      why = "this GPU does not report its total energy";
      close();
    }
  }
  void close() {
    if (shutdown) shutdown();
    if (library) dlclose(library);
    library = nullptr;
    shutdown = nullptr;
    energy = nullptr;
  }
  ~Impl() { close(); }
};

EnergyCounter::EnergyCounter() : impl_(std::make_unique<Impl>()) {}
EnergyCounter::~EnergyCounter() = default;
bool EnergyCounter::available() const { return impl_->energy != nullptr; }
const std::string& EnergyCounter::why_unavailable() const { return impl_->why; }

double EnergyCounter::joules() const {
  unsigned long long millijoules = 0;
  if (!available() || impl_->energy(impl_->device, &millijoules) != 0) return NAN;
  return static_cast<double>(millijoules) * 1e-3;
}

}  // namespace twell::cuda
