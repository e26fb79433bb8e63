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
void Device::synchronize_device() { no_sharing(); }
void Device::copy(void*, const void*, std::size_t) { no_sharing(); }

}  // namespace pymemplan
