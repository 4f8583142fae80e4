// libFuzzer target: TensorFile::parse on arbitrary bytes.
//
// The parser's contract is that bad input becomes a moe::Error and nothing else: any other
// exception escapes this function and libFuzzer reports it as a crash, as it does a sanitizer
// finding or a time-out. A file that parses must also survive the way back: serialized and parsed
// again it gives the same tensors, so the checks accept exactly what the writer produces.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "moe/error.h"
#include "moe/safetensors.h"

namespace {

bool same_tensors(const moe::TensorFile& a, const moe::TensorFile& b) {
  if (a.tensors().size() != b.tensors().size() || a.metadata != b.metadata) return false;
  for (const auto& [name, t] : a.tensors()) {
    if (!b.contains(name)) return false;
    const auto& u = b.get(name);
    if (t.dtype != u.dtype || t.shape != u.shape || t.data != u.data) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  moe::TensorFile file;
  try {
    file = moe::TensorFile::parse(bytes, "fuzz");
  } catch (const moe::Error&) {
    return 0;  // rejected with a message: the expected outcome for most inputs
  }
  for (auto& [name, t] : file.tensors()) {
    // A parsed tensor's bytes are exactly dtype × shape.
    const auto count = static_cast<std::size_t>(t.numel());
    if (t.data.size() != count * moe::file_dtype_size(t.dtype)) std::abort();
    // Read in parts, it reads back the same bytes: all its elements, and all its rows (a tensor of
    // no rows may claim rows too large to count, which is an error, not a crash).
    if (file.read_range(name, 0, t.numel()).data != t.data) std::abort();
    if (t.shape.empty()) continue;
    try {
      if (file.read_rows(name, 0, t.shape[0]).data != t.data) std::abort();
    } catch (const moe::Error&) {
      if (t.shape[0] != 0) std::abort();
    }
  }
  const auto again = moe::TensorFile::parse(file.serialize(), "fuzz (serialized)");
  if (!same_tensors(file, again)) std::abort();
  return 0;
}
