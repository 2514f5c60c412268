#![allow(dead_code)]
//! Reading fuzz input as a stream of fields.

pub struct Input<'a>(pub &'a [u8]);

impl Input<'_> {
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
    /// Small values most of the time, any value sometimes: reaches both the valid and the
    /// overflowing regions.
    pub fn i64(&mut self) -> i64 {
        match self.u8() % 4 {
            0 => self.u64() as i64,
            1 => -i64::from(self.u8()),
            _ => i64::from(self.u8() % 9),
        }
    }
}
