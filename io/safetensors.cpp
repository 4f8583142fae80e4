#include "moe/safetensors.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <system_error>

#include "core/input_file.h"
#include "io/safetensors_format.h"
#include "moe/error.h"

namespace moe {
namespace {

using safetensors_format::checked_bytes;
using safetensors_format::checked_numel;

std::string describe_errno(int error) {
  return std::error_code(error, std::generic_category()).message();
}

// A range in a message: [first, end), or [first, first + count) when the end overflows int64.
std::string range_text(std::int64_t first, std::int64_t count) {
  std::int64_t end = 0;
  if (!__builtin_add_overflow(first, count, &end)) return fmt::format("[{}, {})", first, end);
  return fmt::format("[{}, {} + {})", first, first, count);
}

// first and count name a range inside [0, size): both >= 0, their sum (checked) at most size.
bool inside(std::int64_t first, std::int64_t count, std::int64_t size) {
  std::int64_t end = 0;
  return first >= 0 && count >= 0 && !__builtin_add_overflow(first, count, &end) && end <= size;
}

std::vector<TensorSpec> specs_of(const std::map<std::string, FileTensor>& tensors) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype, t.shape});
  return specs;
}

}  // namespace

std::size_t file_dtype_size(FileDType dtype) {
  switch (dtype) {
    case FileDType::kBF16:
      return 2;
    case FileDType::kF32:
    case FileDType::kI32:
      return 4;
    case FileDType::kI64:
      return 8;
  }
  return 0;
}

std::string_view file_dtype_name(FileDType dtype) {
  switch (dtype) {
    case FileDType::kBF16:
      return "BF16";
    case FileDType::kF32:
      return "F32";
    case FileDType::kI32:
      return "I32";
    case FileDType::kI64:
      return "I64";
  }
  return "?";
}

std::int64_t FileTensor::numel() const {
  const auto n = checked_numel(shape);
  if (!n) fail("a tensor of shape [{}] has a negative or too large size", fmt::join(shape, ", "));
  return *n;
}

Tensor FileTensor::view() {
  DType dtype_view = DType::kFP32;
  switch (dtype) {
    case FileDType::kBF16:
      dtype_view = DType::kBF16;
      break;
    case FileDType::kF32:
      dtype_view = DType::kFP32;
      break;
    case FileDType::kI32:
      dtype_view = DType::kInt32;
      break;
    case FileDType::kI64:
      fail("FileTensor::view: I64 tensors have no moe::DType");
  }
  return Tensor(data.data(), dtype_view, shape);
}

// ---- TensorSource ------------------------------------------------------------------------------

TensorInfo TensorSource::check_range(const std::string& name, std::int64_t first,
                                     std::int64_t count) const {
  TensorInfo t = info(name);
  if (!inside(first, count, t.numel)) {
    fail("{}: elements {} of tensor '{}' lie outside its {} elements", source(),
         range_text(first, count), name, t.numel);
  }
  return t;
}

void TensorSource::read_into(const std::string& name, std::int64_t first, std::int64_t count,
                             std::span<std::byte> out) const {
  const TensorInfo t = check_range(name, first, count);
  // Inside the tensor, whose byte count the header (or add) checked: no overflow here.
  const std::size_t element = file_dtype_size(t.dtype);
  const auto bytes = static_cast<std::uint64_t>(count) * element;
  if (out.size() != bytes) {
    fail("{}: elements {} of tensor '{}' are {} bytes of {}, but the buffer holds {}", source(),
         range_text(first, count), name, bytes, file_dtype_name(t.dtype), out.size());
  }
  if (bytes > 0) read_bytes(name, static_cast<std::uint64_t>(first) * element, out);
}

FileTensor TensorSource::read_range(const std::string& name, std::int64_t first,
                                    std::int64_t count) const {
  const TensorInfo t = check_range(name, first, count);
  FileTensor out;
  out.dtype = t.dtype;
  out.shape = {count};
  out.data.resize(static_cast<std::size_t>(count) * file_dtype_size(t.dtype));
  read_into(name, first, count, out.data);
  return out;
}

FileTensor TensorSource::read_rows(const std::string& name, std::int64_t first_row,
                                   std::int64_t rows) const {
  const TensorInfo t = info(name);
  if (t.shape.empty())
    fail("{}: tensor '{}' has no dimensions, so no rows to read", source(), name);
  if (!inside(first_row, rows, t.shape[0])) {
    fail("{}: rows {} of tensor '{}' lie outside its {} rows", source(),
         range_text(first_row, rows), name, t.shape[0]);
  }
  const std::vector<std::int64_t> row_shape(t.shape.begin() + 1, t.shape.end());
  // A tensor of no rows may claim any row size: checked, not assumed to fit.
  const auto row_elements = checked_numel(row_shape);
  std::int64_t first = 0, count = 0;
  if (!row_elements || __builtin_mul_overflow(first_row, *row_elements, &first) ||
      __builtin_mul_overflow(rows, *row_elements, &count)) {
    fail("{}: rows {} of tensor '{}' of shape [{}] have more elements than int64 counts", source(),
         range_text(first_row, rows), name, fmt::join(t.shape, ", "));
  }
  FileTensor out = read_range(name, first, count);
  out.shape = row_shape;
  out.shape.insert(out.shape.begin(), rows);
  return out;
}

FileTensor TensorSource::read_tensor(const std::string& name) const {
  FileTensor out = read_range(name, 0, info(name).numel);
  out.shape = info(name).shape;
  return out;
}

// ---- TensorFile --------------------------------------------------------------------------------

TensorFile TensorFile::parse(std::string_view bytes, std::string_view source) {
  if (bytes.size() < 8)
    fail("{}: {} bytes is too short for a safetensors file", source, bytes.size());
  const std::uint64_t length =
      safetensors_format::header_length(bytes.data(), bytes.size(), source);
  const std::string_view data = bytes.substr(8 + length);
  auto header = safetensors_format::parse_header(bytes.substr(8, length), data.size(), source);
  TensorFile file;
  file.source_ = std::string(source);
  file.metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    FileTensor t;
    t.dtype = e.info.dtype;
    t.shape = std::move(e.info.shape);
    t.data.resize(e.end - e.begin);
    // A zero-byte tensor's buffer may be null, which memcpy must never see.
    if (!t.data.empty()) std::memcpy(t.data.data(), data.data() + e.begin, t.data.size());
    file.tensors_.emplace(std::move(e.name), std::move(t));
  }
  return file;
}

TensorFile TensorFile::read(const std::filesystem::path& path, std::uint64_t max_bytes) {
  // The reader's checks are read()'s: one code path, so the two fail alike on every bad file.
  const TensorFileReader reader(path, max_bytes);
  TensorFile file;
  file.source_ = reader.source();
  file.metadata = reader.metadata();
  // Each tensor read straight into its buffer: the file is never held twice in memory. The
  // buffers add up to the data section, which the size limit bounds.
  for (const auto& name : reader.names()) file.tensors_.emplace(name, reader.read_tensor(name));
  return file;
}

std::string TensorFile::serialize() const {
  std::string out = safetensors_format::encode_header(specs_of(tensors_), metadata);
  for (const auto& [name, t] : tensors_)
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  return out;
}

void TensorFile::write(const std::filesystem::path& path) const {
  TensorFileWriter writer(path, specs_of(tensors_), metadata);
  for (const auto& [name, t] : tensors_) writer.append(name, t.data);
  writer.finish();
}

void TensorFile::add(const std::string& name, FileDType dtype, std::vector<std::int64_t> shape,
                     const void* data) {
  if (name.empty() || name == "__metadata__")
    fail("TensorFile::add: '{}' is not a valid tensor name", name);
  const auto bytes = checked_bytes(shape, dtype);
  if (!bytes || *bytes > std::vector<std::byte>().max_size()) {
    fail("TensorFile::add: tensor '{}' of shape [{}] has a negative dimension or too many bytes",
         name, fmt::join(shape, ", "));
  }
  if (*bytes > 0 && data == nullptr)
    fail("TensorFile::add: tensor '{}' has {} bytes but no data", name, *bytes);
  FileTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(static_cast<std::size_t>(*bytes));
  if (*bytes > 0) std::memcpy(t.data.data(), data, t.data.size());
  tensors_[name] = std::move(t);
}

const FileTensor& TensorFile::get(const std::string& name) const {
  const auto found = tensors_.find(name);
  if (found == tensors_.end()) fail("{}: no tensor named '{}'", source_, name);
  return found->second;
}

FileTensor& TensorFile::get(const std::string& name) {
  return const_cast<FileTensor&>(static_cast<const TensorFile&>(*this).get(name));
}

std::vector<std::string> TensorFile::names() const {
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors_) names.push_back(name);
  return names;
}

TensorInfo TensorFile::info(const std::string& name) const {
  const FileTensor& t = get(name);
  const auto bytes = checked_bytes(t.shape, t.dtype);
  if (!bytes || *bytes != t.data.size()) {
    fail("{}: tensor '{}' holds {} bytes but {}[{}] needs {}", source_, name, t.data.size(),
         file_dtype_name(t.dtype), fmt::join(t.shape, ","),
         bytes ? fmt::format("{}", *bytes) : std::string("more than 64 bits count"));
  }
  return {t.dtype, t.shape, *checked_numel(t.shape)};
}

void TensorFile::read_bytes(const std::string& name, std::uint64_t offset,
                            std::span<std::byte> out) const {
  std::memcpy(out.data(), get(name).data.data() + offset, out.size());
}

// ---- TensorFileReader --------------------------------------------------------------------------

TensorFileReader::TensorFileReader(const std::filesystem::path& path, std::uint64_t max_bytes)
    : source_(path.string()), file_(std::make_unique<InputFile>(path, max_bytes, "tensor file")) {
  const std::uint64_t size = file_->size();
  if (size < 8) fail("{}: {} bytes is too short for a safetensors file", source_, size);
  char prefix[8];
  file_->read_at(0, prefix, 8);
  const std::uint64_t length = safetensors_format::header_length(prefix, size, source_);
  std::string text(static_cast<std::size_t>(length), '\0');
  file_->read_at(8, text.data(), text.size());
  data_start_ = 8 + length;
  auto header = safetensors_format::parse_header(text, size - data_start_, source_);
  metadata_ = std::move(header.metadata);
  for (auto& e : header.entries)
    entries_.emplace(std::move(e.name), Entry{std::move(e.info), e.begin, e.end});
}

TensorFileReader::~TensorFileReader() = default;
TensorFileReader::TensorFileReader(TensorFileReader&&) noexcept = default;
TensorFileReader& TensorFileReader::operator=(TensorFileReader&&) noexcept = default;

std::vector<std::string> TensorFileReader::names() const {
  std::vector<std::string> names;
  for (const auto& [name, e] : entries_) names.push_back(name);
  return names;
}

const TensorFileReader::Entry& TensorFileReader::entry(const std::string& name) const {
  const auto found = entries_.find(name);
  if (found == entries_.end()) fail("{}: no tensor named '{}'", source_, name);
  return found->second;
}

TensorInfo TensorFileReader::info(const std::string& name) const {
  return entry(name).info;
}

std::pair<std::uint64_t, std::uint64_t> TensorFileReader::data_offsets(
    const std::string& name) const {
  const Entry& e = entry(name);
  return {e.begin, e.end};
}

void TensorFileReader::read_bytes(const std::string& name, std::uint64_t offset,
                                  std::span<std::byte> out) const {
  if (file_ == nullptr) fail("{}: this TensorFileReader was moved from", source_);
  file_->read_at(data_start_ + entry(name).begin + offset, out.data(), out.size());
}

// ---- TensorFileWriter --------------------------------------------------------------------------

namespace {

// Exactly `bytes` bytes at `offset` of the file open as `fd`.
void write_at(int fd, std::uint64_t offset, const std::byte* data, std::size_t bytes,
              const std::filesystem::path& path) {
  while (bytes > 0) {
    // One call writes at most 1 GiB: Linux caps a single write near 2 GiB anyway.
    const std::size_t chunk = std::min<std::size_t>(bytes, std::size_t{1} << 30);
    const ssize_t put = ::pwrite(fd, data, chunk, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      fail("writing tensor file '{}' failed at byte {}: {}", path.string(), offset,
           put < 0 ? describe_errno(errno) : "nothing written");
    }
    data += put;
    offset += static_cast<std::uint64_t>(put);
    bytes -= static_cast<std::size_t>(put);
  }
}

}  // namespace

void check_output_path(const std::filesystem::path& path, std::string_view what) {
  namespace fs = std::filesystem;
  std::error_code error;
  // Replacing a link that leads nowhere would write somewhere else than it names.
  if (fs::is_symlink(fs::symlink_status(path, error)) && !fs::exists(path, error)) {
    fail(
        "{} is a symbolic link that leads nowhere (a missing target or a loop); name the file "
        "itself",
        what);
  }
  const fs::file_status status = fs::status(path, error);
  if (fs::is_directory(status)) fail("{} is a directory; name a file", what);
  if (fs::exists(status) && !fs::is_regular_file(status))
    fail("{} is not a regular file; results are written to regular files only", what);
  const fs::path directory = path.parent_path();
  if (!directory.empty() && !fs::is_directory(directory, error)) {
    if (fs::exists(directory, error)) fail("{}: '{}' is not a directory", what, directory.string());
    fail("{}: the directory '{}' does not exist", what, directory.string());
  }
  const std::string name = path.filename().string();
  if (name.size() > kMaxFileNameBytes) {
    fail("{}: the file name '{}...' has {} bytes; file systems take at most {}", what,
         name.substr(0, 40), name.size(), kMaxFileNameBytes);
  }
}

TensorFileWriter::TensorFileWriter(const std::filesystem::path& path,
                                   std::vector<TensorSpec> tensors,
                                   std::map<std::string, std::string> metadata)
    : path_(path) {
  // Name order: the order TensorFile::write lays the data out in, and the order of the JSON keys.
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    if (t.name.empty() || t.name == "__metadata__")
      fail("TensorFileWriter: '{}' is not a valid tensor name", t.name);
    if (i > 0 && tensors[i - 1].name == t.name)
      fail("TensorFileWriter: tensor '{}' is declared twice", t.name);
    if (!checked_bytes(t.shape, t.dtype)) {
      fail("TensorFileWriter: tensor '{}' of shape [{}] has a negative dimension or too many bytes",
           t.name, fmt::join(t.shape, ", "));
    }
  }
  const std::string header = safetensors_format::encode_header(tensors, metadata);
  std::uint64_t offset = header.size();
  for (const TensorSpec& t : tensors) {
    const std::uint64_t bytes = *checked_bytes(t.shape, t.dtype);
    slots_[t.name] = Slot{offset, bytes, 0, t.dtype, t.shape};
    if (__builtin_add_overflow(offset, bytes, &offset))
      fail("TensorFileWriter: the tensors up to '{}' add up to more bytes than 64 bits count",
           t.name);
  }
  if (path.empty()) fail("TensorFileWriter: the path of the tensor file to write is empty");
  check_output_path(path, fmt::format("tensor file '{}'", path.string()));
  std::error_code resolve_error;
  target_ = std::filesystem::weakly_canonical(path, resolve_error);
  if (resolve_error) target_ = path;
  // Beside the target under a name of its own; a long name is shortened (and told apart by its
  // hash) so that the temporary one stays within the file system's name length.
  std::string stem = target_.filename().string();
  if (stem.size() > 160)
    stem = fmt::format("{}~{:x}", stem.substr(0, 140), std::hash<std::string>{}(stem));
  writing_ = target_.parent_path() / fmt::format(".{}.writing.{}", stem, ::getpid());
  const int fd =
      ::open(writing_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    fail("cannot create tensor file '{}' (written first as '{}'): {}", path.string(),
         writing_.string(), describe_errno(errno));
  }
  fd_ = fd;
  // The length prefix is written last, by finish(): until then the file starts with a zero length,
  // which no reader accepts, so a file left by a process killed mid-write never reads as complete.
  std::memcpy(length_prefix_.data(), header.data(), length_prefix_.size());
  std::string unfinished = header;
  std::fill(unfinished.begin(), unfinished.begin() + 8, '\0');
  try {
    write_at(fd_, 0, reinterpret_cast<const std::byte*>(unfinished.data()), unfinished.size(),
             path_);
  } catch (...) {
    discard();
    throw;
  }
}

TensorFileWriter::~TensorFileWriter() {
  if (!finished_) discard();
}

void TensorFileWriter::discard() noexcept {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  std::error_code ignored;  // best effort: the error that led here is the one to report
  std::filesystem::remove(writing_, ignored);
}

const TensorFileWriter::Slot& TensorFileWriter::slot(const std::string& name) const {
  const auto found = slots_.find(name);
  if (found == slots_.end())
    fail("tensor file '{}': no tensor named '{}' was declared", path_.string(), name);
  return found->second;
}

TensorFileWriter::Slot& TensorFileWriter::slot(const std::string& name) {
  return const_cast<Slot&>(static_cast<const TensorFileWriter&>(*this).slot(name));
}

void TensorFileWriter::append(const std::string& name, std::span<const std::byte> bytes) {
  if (fd_ < 0) {
    fail("tensor file '{}': appending to tensor '{}' after the writer {}", path_.string(), name,
         finished_ ? "finished" : "failed");
  }
  Slot& s = slot(name);
  if (bytes.size() > s.bytes - s.written) {
    fail("tensor file '{}': tensor '{}' has {} bytes; {} more after the {} written pass its end",
         path_.string(), name, s.bytes, bytes.size(), s.written);
  }
  try {
    if (refuse_non_finite_) check_finite(name, s, bytes);
    write_at(fd_, s.begin + s.written, bytes.data(), bytes.size(), path_);
  } catch (...) {
    discard();
    throw;
  }
  s.written += bytes.size();
}

void TensorFileWriter::check_finite(const std::string& name, const Slot& s,
                                    std::span<const std::byte> bytes) const {
  if (s.dtype != FileDType::kF32 && s.dtype != FileDType::kBF16) return;
  const std::size_t element = file_dtype_size(s.dtype);
  if (s.written % element != 0 || bytes.size() % element != 0) {
    fail(
        "tensor file '{}': tensor '{}' is checked for NaN and Inf, so its pieces must hold whole "
        "{}-byte elements; {} bytes came after {}",
        path_.string(), name, element, bytes.size(), s.written);
  }
  for (std::size_t i = 0; i < bytes.size() / element; ++i) {
    float value = 0.0f;
    if (s.dtype == FileDType::kBF16) {
      BF16 raw;
      std::memcpy(&raw, bytes.data() + i * element, element);
      value = from_bf16(raw);
    } else {
      std::memcpy(&value, bytes.data() + i * element, element);
    }
    if (std::isfinite(value)) continue;
    std::vector<std::int64_t> index(s.shape.size());
    auto rest = static_cast<std::int64_t>(s.written / element + i);
    for (std::size_t d = s.shape.size(); d-- > 0;) {
      index[d] = rest % s.shape[d];
      rest /= s.shape[d];
    }
    fail(
        "tensor file '{}': tensor '{}' would hold {} at [{}]; results that are not finite are "
        "refused, and the file was not written",
        path_.string(), name, static_cast<double>(value), fmt::join(index, ", "));
  }
}

std::uint64_t TensorFileWriter::remaining(const std::string& name) const {
  const Slot& s = slot(name);
  return s.bytes - s.written;
}

void TensorFileWriter::finish() {
  if (fd_ < 0)
    fail("tensor file '{}': finish() after the writer {}", path_.string(),
         finished_ ? "finished" : "failed");
  for (const auto& [name, s] : slots_) {
    if (s.written != s.bytes) {
      discard();
      fail("tensor file '{}': tensor '{}' got {} of its {} bytes", path_.string(), name, s.written,
           s.bytes);
    }
  }
  try {
    write_at(fd_, 0, length_prefix_.data(), length_prefix_.size(), path_);
  } catch (...) {
    discard();
    throw;
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int error = errno;
    std::error_code ignored;
    std::filesystem::remove(writing_, ignored);
    fail("closing tensor file '{}' failed: {}", path_.string(), describe_errno(error));
  }
  if (::rename(writing_.c_str(), target_.c_str()) != 0) {
    const int error = errno;
    std::error_code ignored;
    std::filesystem::remove(writing_, ignored);
    fail("tensor file '{}': replacing it with the finished '{}' failed: {}", path_.string(),
         writing_.string(), describe_errno(error));
  }
  finished_ = true;
}

}  // namespace moe
