/* The UCP API only: UCT and UCS internals stay out of the bindings. */
#include <ucp/api/ucp.h>
