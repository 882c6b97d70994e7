/* bochscpu-python 0.4.0's wheel links glibc 2.38's C23 parsers; on an older glibc (Debian 12
   has 2.36) these stand in for them. They differ only in reading "0b" prefixes, which Bochs's
   parameter parsing never meets. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

unsigned long long __isoc23_strtoull(const char *s, char **end, int base) {
    return strtoull(s, end, base);
}

int __isoc23_sscanf(const char *s, const char *format, ...) {
    va_list args;
    va_start(args, format);
    int n = vsscanf(s, format, args);
    va_end(args);
    return n;
}
