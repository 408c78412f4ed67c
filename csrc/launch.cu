// The launch helpers' switch (portability.h: programmatic dependent launch), for the bindings.
#include "kernel_common.h"

namespace atom {

void set_programmatic_launch(bool on) { set_pdl(on); }

bool programmatic_launch() { return pdl_enabled(); }

}  // namespace atom
