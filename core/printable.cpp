// Values from a user's file or command line as messages quote them (core/printable.h).
#include "core/printable.h"

#include <fmt/format.h>

#include <cstdint>

#include "moe/error.h"

namespace moe {
namespace {

// Whether a character shows as a blank or not at all although it is none of a space, a tab or a
// newline: the C1 controls, the no-break and Unicode spaces, the soft hyphen, the combining
// grapheme joiner, the zero-width and direction marks, the Hangul fillers, the variation
// selectors, a byte-order mark and the tag characters. A value holding one would look like the
// value it is not.
bool invisible(char32_t code) {
  return (code >= 0x80 && code <= 0xA0) || code == 0xAD || code == 0x34F || code == 0x61C ||
         code == 0x115F || code == 0x1160 || code == 0x1680 || code == 0x180E ||
         (code >= 0x2000 && code <= 0x200F) || (code >= 0x2028 && code <= 0x202F) ||
         (code >= 0x205F && code <= 0x206F) || code == 0x3000 || code == 0x3164 ||
         (code >= 0xFE00 && code <= 0xFE0F) || code == 0xFEFF || code == 0xFFA0 ||
         (code >= 0xE0000 && code <= 0xE007F);
}

}  // namespace

std::string printable(std::string_view whole) {
  const std::string text = excerpt(whole);
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n' || c == '\t') {
      out += c == '\n' ? "\\n" : "\\t";
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence of two to four bytes, decoded (no overlong form); any other
    // byte passes as it is.
    const std::size_t length = c >= 0xC2 && c <= 0xDF   ? 2
                               : (c & 0xF0) == 0xE0     ? 3
                               : c >= 0xF0 && c <= 0xF4 ? 4
                                                        : 1;
    char32_t code = length == 2 ? c & 0x1F : length == 3 ? c & 0x0F : c & 0x07;
    bool sequence = length > 1 && i + length <= text.size();
    for (std::size_t k = 1; sequence && k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      sequence = (next & 0xC0) == 0x80;
      code = (code << 6) | (next & 0x3F);
    }
    const char32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (sequence && code >= least[length] && invisible(code)) {
      out += fmt::format("\\u{:04x}", static_cast<std::uint32_t>(code));
      i += length;
      continue;
    }
    out += static_cast<char>(c);
    ++i;
  }
  return out;
}

}  // namespace moe
