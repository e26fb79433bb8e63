#include "device.hpp"

#include "errors.hpp"

namespace pymemplan {

namespace {
[[noreturn]] void no_vmm() {
  throw DeviceError("this device does not support virtual memory (address reservation and "
                    "page mapping); use a policy without vmm");
}
[[noreturn]] void no_sharing() {
  throw DeviceError("this device does not support page sharing (device-wide synchronize and "
                    "device copies); use share_pages:0");
}
}  // namespace

void* Device::reserve_address(std::size_t) { no_vmm(); }
void Device::release_address(void*, std::size_t) { no_vmm(); }
PageHandle Device::create_page() { no_vmm(); }
void Device::release_page(PageHandle) { no_vmm(); }
void Device::map_page(void*, PageHandle) { no_vmm(); }
void Device::unmap_page(void*) { no_vmm(); }

void Device::map_pages(void* addr, const PageHandle* pages, std::size_t n) {
  auto* at = static_cast<char*>(addr);
  std::size_t k = 0;
  try {
    for (; k < n; ++k) map_page(at + k * granularity(), pages[k]);
  } catch (...) {
    while (k-- > 0) unmap_page(at + k * granularity());
    throw;
  }
}

void Device::unmap_pages(void* addr, std::size_t n) {
  auto* at = static_cast<char*>(addr);
  for (std::size_t k = 0; k < n; ++k) unmap_page(at + k * granularity());
}
void Device::synchronize_device() { no_sharing(); }
void Device::copy(void*, const void*, std::size_t) { no_sharing(); }

}  // namespace pymemplan
